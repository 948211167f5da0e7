"""Randomized runs of the KV cache manager against a simulated KV cache.

A tiny scheduler+worker drives the manager with random admissions (shared prefixes, two tenants),
chunked prefill, decode, speculative steps with rollback, forks, preemptions, aborts and cache
resets. The simulated worker writes into each slot what real KV would depend on (tenant and
every token up to that position) and copies blocks when a fork asks; after every operation each
sequence must read back exactly its own history through its block table, and the bookkeeping
invariants must hold. Seeded, so a failure replays.
"""

import random

import pytest

from actors.kv import KVCacheConfig, KVCacheManager, KVRequest

BS = 4
PREFIXES = [[7] * 9, list(range(20)), [3, 1, 4, 1, 5, 9, 2, 6]]


class Sim:
    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        self.rng = rng
        self.m = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, max_events=1_000_000))
        self.kv: list[object] = [None] * (num_blocks * BS)  # slot -> what was written there
        self.seqs: dict[str, dict] = {}  # rid -> {"tokens", "salt", "prompt_len"}
        self.next_id = 0
        self.cached_hashes: set[bytes] = set()  # replayed from the events

    # -- the simulated worker ---------------------------------------------------------------
    def write(self, rid: str, start: int, end: int, tokens: list[int]) -> None:
        table, salt = self.m.block_table(rid), self.seqs[rid]["salt"]
        for pos in range(start, end):
            self.kv[table[pos // BS] * BS + pos % BS] = (salt, tuple(tokens[:pos + 1]))

    def check_contents(self) -> None:
        for rid, s in self.seqs.items():
            table = self.m.block_table(rid)
            for pos in range(self.m.num_computed_tokens(rid)):
                got = self.kv[table[pos // BS] * BS + pos % BS]
                assert got == (s["salt"], tuple(s["tokens"][:pos + 1])), (rid, pos)

    # -- operations ---------------------------------------------------------------------------
    def admit(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = list(self.rng.choice(PREFIXES)) + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 9))]
        tokens = tokens[:self.rng.randrange(1, len(tokens) + 1)]
        salt = self.rng.choice([None, None, "t1"])
        hit = self.m.get_computed_blocks(KVRequest(rid, tokens, salt))
        assert hit.num_computed_tokens % BS == 0 and hit.num_computed_tokens < len(tokens)
        chunk = self.rng.randrange(1, len(tokens) - hit.num_computed_tokens + 1)
        if not self.m.can_allocate(rid, chunk, hit=hit):
            return self.preempt()
        self.m.allocate_slots(rid, chunk, hit=hit)
        self.seqs[rid] = {"tokens": tokens, "salt": salt, "prompt_len": len(tokens)}
        self.write(rid, hit.num_computed_tokens, hit.num_computed_tokens + chunk, tokens)

    def step(self, rid: str) -> None:
        s, m = self.seqs[rid], self.m
        done = m.num_computed_tokens(rid)
        pending = len(s["tokens"]) - done
        if pending > 1 or done < s["prompt_len"]:  # a prefill chunk (or a fork catching up)
            n = self.rng.randrange(1, pending + 1)
            if not m.can_allocate(rid, n):
                return self.preempt()
            m.allocate_slots(rid, n)
            return self.write(rid, done, done + n, s["tokens"])
        if pending == 0:  # the last chunk's logits gave a token
            self.append(rid, [self.rng.randrange(50)])
        k = self.rng.choice([0, 0, 1, 3])
        if not m.can_allocate(rid, 1, num_lookahead_tokens=k):
            return self.preempt()
        m.allocate_slots(rid, 1, num_lookahead_tokens=k)
        drafts = [self.rng.randrange(50) for _ in range(k)]
        self.write(rid, done, done + 1 + k, s["tokens"] + drafts)
        accepted = self.rng.randrange(k + 1)
        if k:
            self.append(rid, drafts[:accepted] + [self.rng.randrange(50)])
            m.trim(rid, done + 1 + accepted)
        # Computed: everything fed so far; after a speculative step the bonus token is not.
        assert m.num_computed_tokens(rid) == len(s["tokens"]) - (1 if k else 0)

    def append(self, rid: str, tokens: list[int]) -> None:
        self.seqs[rid]["tokens"] += tokens
        self.m.append_token_ids(rid, tokens)

    def fork(self, rid: str) -> None:
        s = self.seqs[rid]
        computed = self.m.num_computed_tokens(rid)
        # Either the whole computed length (copying a partial block) or a block boundary below it.
        length = self.rng.choice([None, computed // BS * BS])
        if computed < s["prompt_len"] or not self.m.can_fork(rid, length):
            return
        dst = f"r{self.next_id}"
        self.next_id += 1
        copies = self.m.fork(rid, dst, length)
        for src_block, dst_block in copies:
            self.kv[dst_block * BS:(dst_block + 1) * BS] = self.kv[src_block * BS:(src_block + 1) * BS]
        self.seqs[dst] = {"tokens": s["tokens"][:computed], "salt": s["salt"], "prompt_len": s["prompt_len"]}

    def preempt(self) -> None:
        if self.seqs:
            self.finish(self.rng.choice(sorted(self.seqs)))

    def finish(self, rid: str) -> None:
        self.m.free(rid)
        del self.seqs[rid]

    def replay_events(self) -> None:
        for event in self.m.take_events():
            kind = type(event).__name__
            if kind == "BlockStored":
                assert not self.cached_hashes & set(event.block_hashes), "a hash stored twice"
                self.cached_hashes |= set(event.block_hashes)
            elif kind == "BlockRemoved":
                assert set(event.block_hashes) <= self.cached_hashes, "removal of an unknown hash"
                self.cached_hashes -= set(event.block_hashes)
            else:
                self.cached_hashes.clear()
        assert self.cached_hashes == set(self.m.snapshot()[1])

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            r = self.rng.random()
            if r < 0.25 or not self.seqs:
                self.admit()
            elif r < 0.80:
                self.step(self.rng.choice(sorted(self.seqs)))
            elif r < 0.87:
                self.fork(self.rng.choice(sorted(self.seqs)))
            elif r < 0.995:
                self.finish(self.rng.choice(sorted(self.seqs)))
            else:
                self.m.reset_prefix_cache()
            self.m.check_invariants()
            self.check_contents()
            self.replay_events()
        for rid in sorted(self.seqs):
            self.finish(rid)
        self.m.check_invariants()
        self.replay_events()
        assert self.m.num_free_blocks == self.m.num_total_blocks  # every block free or cached-and-evictable
        assert self.m.num_seqs == 0


@pytest.mark.parametrize("seed", range(40))
def test_random_operation_sequences_keep_kv_consistent(seed):
    rng = random.Random(seed)
    Sim(rng, num_blocks=rng.choice([6, 12, 40])).run(300)


def test_random_runs_exercise_hits_and_evictions():
    """Guards the generator above: the interesting paths must actually happen."""
    sim = Sim(random.Random(1234), num_blocks=12)
    events = []
    original = sim.m.take_events

    def spy():
        got = original()
        events.extend(got)
        return got

    sim.m.take_events = spy
    sim.run(600)
    kinds = {type(e).__name__ for e in events}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert sim.m.stats.hit_tokens > 0
