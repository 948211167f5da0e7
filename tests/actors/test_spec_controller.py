"""Adaptive speculation: k follows each sequence's acceptance, and big batches do not speculate."""

from actors.draft.controller import SpecController, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(1.0, 3) == 4.0


def test_good_acceptance_keeps_full_k_and_poor_turns_it_off():
    c = SpecController(4, verify_cost=0.05)
    assert c.choose([1, 2]) == {1: 4, 2: 4}          # the prior is optimistic
    for _ in range(10):
        c.observe(1, 4, 4)                           # always accepted
        c.observe(2, 4, 0)                           # never accepted
    assert c.alpha(1) > 0.9 and c.alpha(2) < 0.1
    assert c.choose([1, 2]) == {1: 4, 2: 0}


def test_middling_acceptance_lowers_k():
    c = SpecController(8, verify_cost=0.2)
    for _ in range(20):
        c.observe(7, 2, 1)                           # alpha about 0.5
    k = c.choose([7])[7]
    assert 1 <= k < 8


def test_switched_off_sequences_probe_again():
    c = SpecController(4, probe_interval=3)
    for _ in range(10):
        c.observe(5, 4, 0)
    ks = [c.choose([5])[5] for _ in range(12)]
    assert ks == [0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]  # probes after 3 steps, then after 6
    for _ in range(10):                              # the text turned into a quote: drafts hit again
        c.observe(5, 1, 1)
    assert c.choose([5])[5] > 0


def test_large_batches_do_not_speculate():
    c = SpecController(4, disable_batch_size=3)
    assert min(c.choose([1, 2, 3]).values()) > 0
    assert set(c.choose([1, 2, 3, 4]).values()) == {0}


def test_a_sequence_in_a_larger_batch_needs_a_higher_acceptance_to_draft():
    """Its drafts slow the whole step: at 16 sequences drafting k costs 16 sequences' time, and
    pays only if its own extra tokens make up for that."""
    c = SpecController(8, verify_cost=0.02, measure_cost=False)
    for _ in range(30):
        c.observe(1, 4, 2)                           # alpha = 2/3
        c.observe(2, 4, 4)
        c.observe(2, 4, 3)                           # alpha = 7/8
    alone = c.choose([1])[1]
    assert alone >= 4
    batch = c.choose(list(range(1, 17)))
    assert 0 < batch[1] < alone                      # a shorter k at batch 16
    assert batch[2] > batch[1]                       # the better draft still drafts longer
    c.observe(3, 4, 1)
    for _ in range(30):
        c.observe(3, 4, 1)
        c.observe(3, 4, 0)                           # alpha = 1/3: worth it alone, not in a crowd
    assert c.choose([3])[3] > 0
    assert c.choose(list(range(3, 19)))[3] == 0


def test_fixed_k_without_adaptation_and_forget():
    c = SpecController(3, adaptive=False)
    c.observe(1, 3, 0)
    assert c.choose([1]) == {1: 3}
    assert c.num_tracked == 1
    c.forget(1)
    assert c.num_tracked == 0


def test_new_sequences_start_from_the_engines_recent_acceptance():
    fresh = SpecController(4, verify_cost=0.05)
    assert fresh.choose([9])[9] > 0                  # the configured prior: optimistic
    poor = SpecController(4, verify_cost=0.05)
    for sid in range(1, 6):                          # a draft that never agrees, request after request
        for _ in range(6):
            poor.observe(sid, 4, 0)
        poor.forget(sid)
    assert poor.alpha(9) < 0.1
    assert poor.choose([9])[9] == 0                  # starts switched off, probes later
    good = SpecController(4, verify_cost=0.05, prior_alpha=0.3)
    for _ in range(20):
        good.observe(1, 4, 4)
    assert good.alpha(2) > 0.9                       # a copying workload: new sequences draft at once


def test_no_probes_where_even_a_perfect_draft_would_not_pay():
    """A layer-skip draft costs a third of a step per token at batch 1; at 16 sequences, the draft
    of one sequence delays the fifteen others more than any accepted token could make up."""
    c = SpecController(4, draft_cost=0.33, verify_cost=0.05, probe_interval=2, measure_cost=False)
    for _ in range(10):
        c.observe(5, 4, 0)
    batch = list(range(5, 21))
    assert all(c.choose(batch)[5] == 0 for _ in range(40))
    assert 1 in [c.choose([5])[5] for _ in range(40)]   # alone, it still tries again


def test_new_sequences_keep_the_engines_probe_back_off():
    """A draft that never agrees, request after request: each new sequence waits as long before its
    first probe as the last failed probe of the one before, not probe_interval again."""
    c = SpecController(4, probe_interval=2)

    def first_probe(sid: int) -> int:
        for step in range(1, 200):
            if c.choose([sid])[sid]:
                c.observe(sid, 1, 0)                 # the probe fails
                return step
        return 0

    for sid in range(1, 5):                          # the engine learns that drafts never hit
        for _ in range(10):
            c.observe(sid, 4, 0)
        c.forget(sid)
    waits = []
    for sid in range(10, 16):
        waits.append(first_probe(sid))
        c.forget(sid)
    assert waits[0] == 2 and waits == sorted(waits) and waits[-1] >= 16
    for step in range(1, 200):                       # a sequence whose probe is accepted
        if c.choose([50])[50]:
            c.observe(50, 1, 1)
            break
    assert first_probe(60) == 2                      # new sequences probe early again


def test_a_sequence_that_drafted_well_probes_soon_after_switching_off():
    """The engine's long back-off is for new sequences: one that was copying and hit an edit comes
    back to its quote within probe_interval steps."""
    c = SpecController(4, probe_interval=2)
    for sid in range(1, 5):
        for _ in range(10):
            c.observe(sid, 4, 0)
        c.forget(sid)
    for sid in range(10, 16):                        # failed probes: the engine's back-off grows
        while not c.choose([sid])[sid]:
            pass
        c.observe(sid, 1, 0)
        c.forget(sid)
    for _ in range(20):
        c.observe(7, 4, 4)                           # copying
    assert c.choose([7])[7] > 0
    for _ in range(60):
        c.observe(7, 4, 0)                           # an edit: drafts stop agreeing
    ks = [c.choose([7])[7] for _ in range(3)]
    assert ks == [0, 1, 0]
