"""A decode engine's side of the HandoffTracker, alone (actors/scheduler/handoffs.py): a request another
engine prefilled gets its blocks reserved before its KV arrives, joins the request table only once
adopted, and gives its blocks back when its handoff is cut. No scheduler and no KV manager: the
tracker's own answers and the request table's state are what a caller sees."""
from __future__ import annotations

import msgspec

from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.messages.handoff import HandoffOffer
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.counters import Counters
from actors.scheduler.handoffs import HandoffTracker
from actors.scheduler.requests import RequestTable
from actors.scheduler.sequence import SeqStatus

OFFER = HandoffOffer("o", None, "r", [1, 2, 3, 4, 5], [], SamplingParams(max_tokens=4), "client", 0, "salt", 3, "")


def tracker() -> HandoffTracker:
    requests = RequestTable(SchedulerConfig(8, 64, 4, 64), Counters(), lambda: 0.0, {})
    return HandoffTracker(4, requests)


def test_an_offer_reserves_every_prompt_position_and_each_sampled_token_but_the_last():
    t = tracker()
    ahead = t.reserve_adoption(OFFER)   # ahead of the first token: every prompt position has KV
    assert (ahead.token_ids, ahead.num_tokens, ahead.cache_salt) == ([1, 2, 3, 4, 5], 5, "salt")
    sampled = t.reserve_adoption(msgspec.structs.replace(OFFER, request_id="s", output_token_ids=[7, 8]))
    assert (sampled.token_ids, sampled.num_tokens) == ([1, 2, 3, 4, 5, 7, 8], 6)
    assert sampled.seq_id != ahead.seq_id
    assert t.adopting() and not t.requests and not t.requests.seqs   # reserved, not in the table yet


def test_a_request_is_reserved_once_while_adopting_and_not_at_all_once_here():
    t = tracker()
    reserve = t.reserve_adoption(OFFER)
    assert t.reserve_adoption(OFFER) is None
    t.adopt(reserve.seq_id, [9])
    assert t.reserve_adoption(OFFER) is None and not t.adopting()
    t.requests.add(SubmitRequest("local", [1, 2], SamplingParams(), "client"))
    assert t.reserve_adoption(msgspec.structs.replace(OFFER, request_id="local")) is None


def test_an_adopted_sequence_joins_the_table_decoding_from_its_first_token():
    t = tracker()
    reserve = t.reserve_adoption(OFFER)
    seq = t.adopt(reserve.seq_id, [9])
    assert seq.status is SeqStatus.RUNNING and (seq.num_tokens, seq.num_computed) == (6, 5)
    assert seq.output_token_ids == [9] and seq.request.num_cached_tokens == 3
    assert t.requests["r"] is seq.request and t.requests.seqs == {seq.seq_id: seq}
    assert t.requests.counters.prompt_tokens == 5
    assert t.requests.take_frees() is None   # its blocks are the sequence's now


def test_a_cut_handoff_gives_back_the_blocks_reserved_for_it():
    t = tracker()
    kept = t.reserve_adoption(OFFER)
    refused = t.reserve_adoption(msgspec.structs.replace(OFFER, request_id="s"))
    t.drop_adoption(refused.seq_id, reserved=False)   # the KV manager had no room: nothing to give back
    assert t.requests.take_frees() is None and t.adopting()
    t.drop_adoption(kept.seq_id)
    t.drop_adoption(kept.seq_id)   # a second cut finds nothing
    assert t.requests.take_frees().seq_ids == [kept.seq_id]
    assert not t.adopting() and not t.requests
