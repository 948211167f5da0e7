"""Disaggregation in the scheduler (its HandoffTracker).

A prefill engine's scheduler sends a long prompt's KV ahead: after each chunk, the full blocks it
has computed go to the decode engine while the next chunk runs; the HandoffSend after the first token
sends the rest. A sequence sent ahead that is preempted, aborted or ends at its first token
cancels what went ahead (the decode engine lets the blocks go). Where the blocks go layer by layer,
each planned step names the blocks it fills, and a sequence so named cancels as one sent ahead does.

The scheduler with the real KV manager and the paged fake model (tests/actors/test_scheduler.py);
the harness plays the scheduler actor and the transfer actor: it records what goes ahead, what is
cancelled and what is handed over, and hands each handoff's blocks back at once. A decode engine's
scheduler reserves blocks for a request another engine prefilled, and decodes it once adopted."""
from __future__ import annotations

import msgspec

from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.messages.handoff import HandoffOffer
from tests.actors.test_scheduler import Harness, reference


class HandoffHarness(Harness):
    def __init__(self, layers: bool = False, **kw):
        super().__init__(**kw)
        # ("ahead", seq, blocks) / ("cancel", seq, 0) / ("handover", seq, tokens) / ("layers", seq, (first, end))
        self.events: list[tuple[str, int, object]] = []
        if layers:   # as the scheduler actor does with a host cache: each planned step names its blocks
            plan = self.scheduler.plan

            def planned():
                out = plan()
                for seq_id in self.scheduler.handoffs.take_cancelled_ahead():   # before a recompute's blocks
                    self.events.append(("cancel", seq_id, 0))
                for seq, first, end in self.scheduler.handoffs.take_layered():
                    self.events.append(("layers", seq.seq_id, (first, end)))
                return out
            self.scheduler.plan = planned

    def submit_handoff(self, rid, prompt, **params):
        params.setdefault("max_tokens", 8)
        self.scheduler.add(SubmitRequest(rid, prompt, SamplingParams(**params), "client", handoff_to="decoder"))
        self._collect()

    def _collect(self):
        # As the scheduler actor does: cancels first, then what goes ahead, then the handoffs.
        for seq_id in self.scheduler.handoffs.take_cancelled_ahead():
            self.events.append(("cancel", seq_id, 0))
        for seq, num_blocks in self.scheduler.handoffs.take_ready_ahead():
            assert num_blocks * self.kv.block_size <= self.kv.num_computed_tokens(str(seq.seq_id))
            self.events.append(("ahead", seq.seq_id, num_blocks))
        for seq in self.scheduler.handoffs.take_handoffs():
            self.events.append(("handover", seq.seq_id, seq.num_tokens))
            self.scheduler.handoff_done(seq.seq_id)
        super()._collect()


def test_each_chunks_full_blocks_go_ahead_and_the_handover_follows_the_first_token():
    h = HandoffHarness(block_size=4, budget=16)
    prompt = list(range(3, 53))   # 50 tokens: chunks of 16, 16, 16 and 2
    h.submit_handoff("long", prompt)
    h.submit_handoff("short", [7, 8, 9])   # one chunk: nothing goes ahead
    h.run()
    long_id = next(seq for kind, seq, n in h.events if kind == "handover" and n == 51)
    assert [e for e in h.events if e[1] == long_id] == [
        ("ahead", long_id, 4), ("ahead", long_id, 8), ("ahead", long_id, 12), ("handover", long_id, 51)]
    assert [kind for kind, seq, _ in h.events if seq != long_id] == ["handover"]
    assert h.outputs[("long", 0)] == reference(prompt, 1) and h.outputs[("short", 0)] == reference([7, 8, 9], 1)
    h.assert_all_free()


def test_a_request_that_ends_at_its_first_token_cancels_what_went_ahead():
    h = HandoffHarness(block_size=4, budget=16)
    prompt = list(range(3, 40))
    h.submit_handoff("one", prompt, max_tokens=1)
    h.run()
    assert [kind for kind, _, _ in h.events] == ["ahead", "ahead", "cancel"]
    assert h.outputs[("one", 0)] == reference(prompt, 1) and h.finish[("one", 0)] == "length"
    h.assert_all_free()


def test_an_abort_mid_prefill_cancels_what_went_ahead_and_frees_the_blocks():
    h = HandoffHarness(block_size=4, budget=16)
    h.submit_handoff("gone", list(range(3, 60)))
    h.step()
    h.step()
    assert [kind for kind, _, _ in h.events] == ["ahead", "ahead"]
    h.abort("gone")
    assert [kind for kind, _, _ in h.events] == ["ahead", "ahead", "cancel"]
    assert h.finish[("gone", 0)] == "abort"
    h.assert_all_free()


def test_a_preempted_prompt_cancels_what_went_ahead_and_sends_it_again_when_recomputed():
    h = HandoffHarness(num_blocks=12, block_size=4, budget=4, max_model_len=48)
    h.submit("decoding", [1] * 8, max_tokens=30)   # grows one block every 4 steps
    prompt = list(range(100, 130))                  # 30 tokens, 3 a step beside the decode
    h.submit_handoff("prefilling", prompt)
    h.run()
    assert h.scheduler.counters.preemptions > 0
    ids = {seq for _, seq, _ in h.events}
    assert len(ids) == 1   # only the handed-over request goes ahead
    kinds = [kind for kind, _, _ in h.events]
    assert "cancel" in kinds and kinds[-1] == "handover"
    assert "ahead" in kinds[kinds.index("cancel"):]   # recomputed, it goes ahead again
    # Between cancels, each step sends more blocks than the one before.
    run: list[int] = []
    for kind, _, n in h.events:
        if kind == "ahead":
            assert not run or n > run[-1]
            run.append(n)
        else:
            run = []
    assert h.outputs[("decoding", 0)] == reference([1] * 8, 30)
    assert h.outputs[("prefilling", 0)] == reference(prompt, 1)
    h.assert_all_free()


def test_each_planned_step_names_the_blocks_it_fills_the_last_one_with_the_prompts_partial_block():
    h = HandoffHarness(block_size=4, budget=16, layers=True)
    prompt = list(range(3, 53))   # 50 tokens: chunks of 16, 16, 16 and 2
    h.submit_handoff("long", prompt)
    h.run()
    long_id = next(seq for kind, seq, n in h.events if kind == "handover")
    assert [e for e in h.events if e[0] == "layers"] == [
        ("layers", long_id, (0, 4)), ("layers", long_id, (4, 8)), ("layers", long_id, (8, 12)),
        ("layers", long_id, (12, 13))]   # positions 48-49: block 12, partly
    assert [kind for kind, _, _ in h.events if kind != "layers"] == ["ahead", "ahead", "ahead", "handover"]
    assert h.outputs[("long", 0)] == reference(prompt, 1)
    h.assert_all_free()


def test_a_one_chunk_prompt_named_by_its_step_cancels_when_it_ends_at_its_first_token():
    h = HandoffHarness(block_size=4, budget=16, layers=True)
    h.submit_handoff("one", [7, 8, 9, 10, 11], max_tokens=1)
    h.run()
    assert [(kind, data) for kind, _, data in h.events] == [("layers", (0, 2)), ("cancel", 0)]
    h.assert_all_free()


def test_a_preempted_prompt_named_by_its_steps_is_cancelled_before_its_recompute_names_them_again():
    h = HandoffHarness(num_blocks=12, block_size=4, budget=4, max_model_len=48, layers=True)
    h.submit("decoding", [1] * 8, max_tokens=30)
    prompt = list(range(100, 130))
    h.submit_handoff("prefilling", prompt)
    h.run()
    assert h.scheduler.counters.preemptions > 0
    named = [(kind, data) for kind, _, data in h.events if kind in ("layers", "cancel")]
    last_end, cancelled, restarts = 0, False, 0
    for kind, data in named:
        if kind == "cancel":
            cancelled = True
            continue
        if data[0] < last_end - 1:   # blocks named again: a recompute, whose cancel came first
            assert cancelled
            restarts += 1
        last_end, cancelled = data[1], False
    assert restarts
    assert h.outputs[("prefilling", 0)] == reference(prompt, 1)
    h.assert_all_free()


def test_an_adopted_request_reserves_its_blocks_then_decodes_from_its_first_token():
    h = Harness(block_size=4)
    offer = HandoffOffer("o", None, "r", [1, 2, 3, 4, 5], [], SamplingParams(max_tokens=4, ignore_eos=True), "client",
                    0, None, 0, "")
    reserve = h.scheduler.reserve_adoption(offer)   # ahead of the first token: every prompt position has KV
    assert (reserve.token_ids, reserve.num_tokens) == ([1, 2, 3, 4, 5], 5)
    assert h.scheduler.reserve_adoption(offer) is None and h.scheduler.handoffs.adopting()
    assert not h.scheduler.has_work()   # reserved, not yet scheduled
    seq = h.scheduler.adopt(reserve.seq_id, [9])
    assert (seq.num_tokens, seq.num_computed) == (6, 5) and h.scheduler.running == [seq]
    assert not h.scheduler.handoffs.adopting() and h.scheduler.reserve_adoption(offer) is None   # here now
    other = h.scheduler.reserve_adoption(msgspec.structs.replace(offer, request_id="s", output_token_ids=[7]))
    assert other.num_tokens == 5   # the sampled token's KV is not written yet
    h.scheduler.drop_adoption(other.seq_id)
    assert h.scheduler.take_frees().seq_ids == [other.seq_id] and not h.scheduler.handoffs.adopting()
