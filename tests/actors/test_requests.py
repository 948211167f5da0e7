"""The scheduler's request table (actors/scheduler/requests.py), alone: what a request becomes when
it comes in, how its samples fork, and what each end sends out (deltas, frees, released sampler
state). No queues and no KV manager: the table never touches either."""
from __future__ import annotations

import pytest

from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.messages.handoff import HandoffOffer
from actors.messages.kv import KVUnwritten
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import Counters
from actors.scheduler.requests import EMPTY_PROMPT, RequestTable
from actors.scheduler.sequence import SeqStatus

EOS = 99


def table(priority_scheduling: bool = False, block_size: int = 4, max_model_len: int = 64) -> RequestTable:
    cfg = SchedulerConfig(8, 64, block_size, max_model_len, frozenset({EOS, 98}), priority_scheduling)
    return RequestTable(cfg, Counters(), lambda: 12.5, {"a": "a@1"})


def submit(rid: str, prompt: list[int], reply_to: str = "client", **kw) -> SubmitRequest:
    fields = {k: kw.pop(k) for k in ("priority", "handoff_to", "ballast", "lora_name") if k in kw}
    return SubmitRequest(rid, prompt, SamplingParams(**kw), reply_to, **fields)


def deltas(t: RequestTable) -> list[tuple]:
    return [(d.request_id, d.index, d.token_ids, d.finish_reason, d.error)
            for ds in t.take_deltas().values() for d in ds]


def test_a_request_becomes_its_first_sequence_and_is_looked_up_by_id():
    t = table()
    leader = t.add(submit("r", [1, 2, 3], max_tokens=5, lora_name="a"))
    assert leader.index == 0 and leader.status is SeqStatus.WAITING and leader.token_ids == [1, 2, 3]
    assert "r" in t and len(t) == 1 and list(t) == ["r"] and t["r"] is leader.request
    assert t.seqs == {leader.seq_id: leader}
    assert t.counters.prompt_tokens == 3 and t.counters.lora_requests == {"a": 1}
    assert t["r"].arrived_s == 12.5 and t["r"].max_output == 5
    with pytest.raises(ValueError, match="already in the engine"):
        t.add(submit("r", [4]))
    other = t.add(submit("s", [4]))
    assert other.seq_id != leader.seq_id and other.request.arrival > leader.request.arrival
    assert not deltas(t)


def test_a_request_that_cannot_run_ends_at_once_with_a_delta_per_sample():
    t = table(max_model_len=8)
    assert t.add(submit("empty", [], n=2)) is None
    assert t.add(submit("full", list(range(8)))) is None   # no room left in the context
    assert deltas(t) == [("empty", 0, [], "error", EMPTY_PROMPT), ("empty", 1, [], "error", EMPTY_PROMPT),
                         ("full", 0, [], "length", None)]
    assert not t and not t.seqs and t.counters.prompt_tokens == 0


def test_min_tokens_holds_off_the_engines_eos_ids_and_priority_counts_only_when_on():
    t = table()
    held = t.add(submit("held", [1], min_tokens=2, priority=-3)).request
    free = t.add(submit("free", [1], min_tokens=2, ignore_eos=True)).request
    assert held.params.eos_token_ids == [98, EOS] and free.params.eos_token_ids == []
    assert held.priority == 0
    assert table(priority_scheduling=True).add(submit("urgent", [1], priority=-3)).request.priority == -3


def test_only_a_plain_request_is_handed_over():
    t = table()
    plain = t.add(submit("plain", [1, 2], handoff_to="decoder")).request
    samples = t.add(submit("samples", [1, 2], n=2, handoff_to="decoder")).request
    logprobs = t.add(submit("logprobs", [1, 2], prompt_logprobs=1, handoff_to="decoder")).request
    adapter = t.add(submit("adapter", [1, 2], lora_name="a", handoff_to="decoder")).request
    assert plain.handoff_to == "decoder"
    assert samples.handoff_to is logprobs.handoff_to is adapter.handoff_to is None


def test_samples_fork_from_the_prompts_full_blocks_once():
    t = table(block_size=4)
    leader = t.add(submit("r", list(range(10)), n=3))
    assert t.spawn_samples(leader) != []
    assert len(leader.request.seqs) == 3 and t.spawn_samples(leader) == []   # once
    children = leader.request.seqs[1:]
    assert [c.index for c in children] == [1, 2]
    assert all(c.status is SeqStatus.RUNNING and c.num_computed == 8 for c in children)   # two full blocks
    assert t.forking() and t.fork_parents() == {leader.seq_id}
    forks, forked = t.take_forks()
    assert forked == children
    assert [(f.parent_seq_id, f.child_seq_id, f.num_tokens) for f in forks] == [
        (leader.seq_id, c.seq_id, 8) for c in children]
    assert not t.forking() and t.take_forks() == ([], [])
    assert t.spawn_samples(children[0]) == []   # only sample 0 spawns


def test_samples_of_a_prompt_within_one_block_wait_like_new_requests():
    t = table(block_size=4)
    leader = t.add(submit("r", [1, 2, 3, 4], n=2))   # the last token is recomputed: no full block to share
    (child,) = t.spawn_samples(leader)
    assert child.status is SeqStatus.WAITING and child.num_computed == 0 and not t.forking()
    assert t.seqs[child.seq_id] is child


def test_ending_a_request_ends_its_live_sequences_and_the_samples_not_yet_started():
    t = table()
    leader = t.add(submit("r", [1, 2, 3], n=3))
    assert t.end("r", 1, "abort") is None   # sample 1 forks from sample 0 later: nothing to end yet
    assert t.end("r", 0, "abort") == [leader]   # sample 0 before the others: the whole request
    assert "r" not in t
    assert deltas(t) == [("r", 0, [], "abort", None), ("r", 1, [], "abort", None), ("r", 2, [], "abort", None)]
    assert t.end("r", None, "abort") is None and t.end("missing", None, "abort") is None


def test_ending_one_sample_keeps_the_others_and_drops_its_pending_fork():
    t = table()
    leader = t.add(submit("r", list(range(10)), n=3))
    one, two = t.spawn_samples(leader)
    assert t.end("r", 2, "abort", "why") == [two]
    assert deltas(t) == [("r", 2, [], "abort", "why")]
    forks, forked = t.take_forks()
    assert forked == [one]
    assert "r" in t


def test_retiring_frees_blocks_releases_the_worker_state_and_lets_the_request_go_with_its_last_sequence():
    t = table()
    leader = t.add(submit("r", [1, 2, 3], n=1, ballast=True))
    leader.known_to_worker = True
    other = t.add(submit("s", [4, 5]))
    t.retire(leader)
    assert leader.status is SeqStatus.FINISHED and leader.seq_id not in t.seqs and "r" not in t
    assert t.counters.ballast_finished == 1
    t.retire(other)
    assert t.take_frees().seq_ids == [leader.seq_id, other.seq_id] and t.take_frees() is None
    assert t.take_released() == [leader.seq_id] and t.take_released() == []   # `other` never reached the worker


def test_a_fork_parents_free_waits_for_its_forks_and_a_handed_over_sequence_is_not_freed():
    t = table()
    leader = t.add(submit("r", list(range(10)), n=2))
    t.spawn_samples(leader)
    t.end("r", 0, "abort")   # its child has started: only sample 0 ends
    t.retire(leader)
    assert t.take_frees() is None and t.take_deferred_frees() == [leader.seq_id] and t.take_deferred_frees() == []
    handed = t.add(submit("h", [1, 2], handoff_to="decoder"))
    t.retire(handed, free=False)
    assert t.take_frees() is None and "h" not in t
    t.free(handed.seq_id)   # once its KV has left
    assert t.take_frees().seq_ids == [handed.seq_id]


def test_frees_carry_the_kv_a_failed_step_never_wrote():
    t = table()
    t.forget_unwritten([KVUnwritten(7, 3)])
    frees = t.take_frees()
    assert frees.seq_ids == [] and [(u.seq_id, u.num_tokens) for u in frees.unwritten] == [(7, 3)]
    assert t.take_frees() is None


def test_deltas_go_to_each_requests_front_end():
    t = table()
    a = t.add(submit("a", [1, 2], reply_to="front-1"))
    b = t.add(submit("b", [3], reply_to="front-2"))
    t.delta(a, [5], None, None)
    t.delta(b, [6, 7], None, "stop")
    t.delta(a, [8], None, "length")
    out = t.take_deltas()
    assert {ref: [(d.request_id, d.token_ids, d.finish_reason, d.num_prompt_tokens) for d in ds]
            for ref, ds in out.items()} == {"front-1": [("a", [5], None, 2), ("a", [8], "length", 2)],
                                            "front-2": [("b", [6, 7], "stop", 1)]}
    assert t.take_deltas() == {}


def test_an_offered_request_joins_the_table_only_when_it_enters():
    t = table()
    offer = HandoffOffer("o", None, "r", [1, 2, 3], [9], SamplingParams(), "client", 4, None, 2, "", True)
    seq = t.offered(offer)
    assert "r" not in t and seq.seq_id not in t.seqs and t.counters.prompt_tokens == 0
    assert seq.request.num_cached_tokens == 2 and seq.request.ballast and seq.request.priority == 0
    t.enter(seq)
    assert t["r"] is seq.request and t.seqs[seq.seq_id] is seq and t.counters.prompt_tokens == 3
