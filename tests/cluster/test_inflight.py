"""The bookkeeping of a request in flight: deltas as the client sees them, and continuations."""
from actors.messages.front_end import SamplingParams, TokenDelta
from gateway.inflight import InflightRequest


def _delta(rid, index, tokens, finish=None, prompt=3, cached=0):
    return TokenDelta(rid, index, tokens, None, finish, prompt, cached)


def test_continuation_carries_the_tokens_so_far_and_what_is_left():
    req = InflightRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0))
    erid = req.place("A")
    out = req.on_delta(erid, _delta(erid, 0, [7, 8], cached=2))
    assert (out.request_id, out.token_ids, out.num_cached_tokens) == ("r", [7, 8], 2)
    assert req.lose_engine("A") == [0]
    req.migrations += 1
    resub = req.continuation(0)
    assert resub.prompt_token_ids == [1, 2, 3, 7, 8]
    assert resub.params.max_tokens == 8 and resub.params.n == 1
    assert resub.engine_request_id != erid
    req.place_continuation(resub, "B")
    # A late delta of the lost part is dropped; the continuation's deltas keep the original prompt length.
    assert req.on_delta(erid, _delta(erid, 0, [99])) is None
    last = req.on_delta(resub.engine_request_id, _delta(resub.engine_request_id, 0, [9], "length", prompt=5))
    assert (last.token_ids, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens) == \
        ([9], "length", 3, 2)
    assert req.finished and req.generated[0] == [7, 8, 9]


def test_n_samples_continue_one_by_one_and_finished_ones_stay_finished():
    req = InflightRequest("r", [1], SamplingParams(n=3, max_tokens=4))
    erid = req.place("A")
    req.on_delta(erid, _delta(erid, 0, [5]))
    req.on_delta(erid, _delta(erid, 1, [6, 6, 6, 6], "length"))
    assert req.lose_engine("A") == [0, 2]
    conts = [req.continuation(i) for i in (0, 2)]
    assert [c.index for c in conts] == [0, 2]
    assert conts[0].params.max_tokens == 3 and conts[1].params.max_tokens == 4
    for c in conts:
        req.place_continuation(c, "B")
    out = req.on_delta(conts[1].engine_request_id, _delta(conts[1].engine_request_id, 0, [4]))
    assert out.index == 2


def test_aborts_reach_the_part_that_runs_the_sample():
    req = InflightRequest("r", [1], SamplingParams(n=2, max_tokens=4))
    erid = req.place("A")
    req.on_delta(erid, _delta(erid, 0, [5]))
    assert req.abort_targets(1) == [("A", "r", 1)]
    assert req.lose_engine("A") == [0]
    cont = req.continuation(0)
    req.place_continuation(cont, "B")
    assert req.abort_targets(None) == [("B", cont.engine_request_id, None)]
    assert req.finished


def test_a_sample_whose_budget_ran_out_is_not_continued():
    req = InflightRequest("r", [1], SamplingParams(max_tokens=2))
    erid = req.place("A")
    req.on_delta(erid, _delta(erid, 0, [5, 6]))
    req.lose_engine("A")
    assert req.continuation(0) is None
    assert req.finish_locally(0, "length").finish_reason == "length"
    assert req.finished
