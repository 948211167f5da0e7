"""The controller learns what a drafted token costs on this machine from the measured step times."""
import random

from actors.draft.controller import SpecController
from actors.draft.step_cost import StepCostModel


def feed(model, steps, a=0.100, c=0.015, f=0.0, b=0.0, noise=0.0, seed=0, seqs=(1,), ks=(0, 1, 2, 3, 4)):
    rng = random.Random(seed)
    for _ in range(steps):
        n, x = rng.choice(seqs), rng.choice(ks)
        t = a + b * n + c * x + (f if x else 0.0)
        model.observe(n, x, t * (1 + rng.uniform(-noise, noise)))


def test_prior_until_enough_varied_steps():
    m = StepCostModel(prior=0.05, min_steps=8)
    assert m.relative(1) == 0.05 and not m.measured
    feed(m, 7)
    assert m.relative(1) == 0.05                      # too few steps
    m2 = StepCostModel(prior=0.05)
    feed(m2, 30, ks=(4,))
    assert m2.relative(1) == 0.05                     # one draft count: cost not identifiable


def test_learns_the_per_token_cost_of_a_cpu():
    m = StepCostModel(prior=0.05)
    feed(m, 64, a=0.100, c=0.015, noise=0.05)        # a drafted token costs 15% of a step
    assert m.measured
    assert abs(m.relative(1) - 0.15) < 0.03


def test_once_per_step_cost_is_spread_over_the_drafted_tokens():
    m = StepCostModel(prior=0.0)
    feed(m, 64, a=0.100, c=0.010, f=0.020, b=0.010, seqs=(1, 2, 4))
    plain1 = 0.100 + 0.010
    assert abs(m.relative(1, k=1) - (0.010 + 0.020) / plain1) < 1e-6
    assert abs(m.relative(1, k=4) - (0.010 + 0.020 / 4) / plain1) < 1e-6
    plain4 = 0.100 + 0.040
    # Every sequence of the batch drafts k: the once-per-step cost is shared by all their tokens.
    assert abs(m.relative(4, k=1) - (0.010 + 0.020 / 4) / plain4) < 1e-6
    assert abs(m.relative(3, k=2) - (0.010 + 0.020 / 6) / (0.100 + 0.030)) < 1e-6   # shape never seen: the fit
    # One of them drafts: it pays the once-per-step cost alone.
    assert abs(m.relative(4, k=1, drafting=1) - (0.010 + 0.020) / plain4) < 1e-6


def test_a_lone_drafter_in_a_large_batch_pays_the_steps_drafting_overhead():
    """Batch 16 on a CPU: a plain step 175 ms, each drafted row 6 ms, and 8 ms once for drafting at
    all. Amortised over all 16 sequences that 8 ms looks free; one sequence drafting pays all of it,
    and with acceptance 0.9 that does not pay in a batch of 16."""
    m = StepCostModel(prior=0.05)
    feed(m, 64, a=0.095, c=0.006, f=0.008, b=0.005, seqs=(8, 12, 16), ks=(0, 1, 2, 4, 8, 16))
    ctl = SpecController(8, verify_cost=0.05)
    ctl.cost = m
    assert abs(ctl.token_cost(16, 1) - (0.006 + 0.008) / 0.175) < 1e-6
    for _ in range(30):
        ctl.observe(1, 10, 9)                         # alpha = 0.9
        ctl.observe(2, 8, 8)                          # alpha = 1: a copying sequence
    chosen = ctl.choose(list(range(1, 17)))
    assert chosen[1] == 0
    assert chosen[2] >= 4                            # the copying one drafts long
    # Priced only at every sequence drafting (the 8 ms shared by 16 tokens per k), it would draft.
    old = SpecController(8, verify_cost=0.05)
    old.cost, old._seqs = m, ctl._seqs
    old.token_cost = lambda n, k=1: m.relative(n, k)
    assert old.choose(list(range(1, 17)))[1] > 0


def test_a_batch_is_priced_at_its_total_drafted_rows():
    """Drafting 4 for each of 4 sequences puts 16 drafted rows in one step: on a CPU that step costs
    more per token than one sequence drafting 4, and the price must say so."""
    m = StepCostModel(prior=0.05)
    times = {(1, 0): 0.100, (1, 4): 0.110, (4, 0): 0.120, (4, 4): 0.130, (4, 16): 0.300}
    for _ in range(4):
        for (n, x), t in times.items():
            m.observe(n, x, t)
    assert abs(m.relative(1, 4) - (0.110 - 0.100) / (4 * 0.100)) < 1e-9
    assert abs(m.relative(4, 4) - (0.300 - 0.120) / (16 * 0.120)) < 1e-9   # not (0.130 - 0.120) / (4 * 0.120)


def test_a_cpu_cost_curve_that_is_not_linear():
    """A few rows ride along with the weight reads; more turn the matmuls compute-bound."""
    curve = {0: 0.110, 1: 0.112, 2: 0.113, 3: 0.115, 4: 0.135, 8: 0.254}
    m = StepCostModel(prior=0.05)
    for _ in range(5):
        for x, t in curve.items():
            m.observe(1, x, t)
    assert abs(m.relative(1, 3) - (0.115 - 0.110) / (3 * 0.110)) < 1e-9   # its own median
    assert abs(m.relative(1, 8) - (0.254 - 0.110) / (8 * 0.110)) < 1e-9
    ctl = SpecController(8, verify_cost=0.05)
    ctl.cost = m
    for _ in range(30):
        ctl.observe(1, 4, 4)
        ctl.observe(1, 4, 2)       # alpha = 6/7
    assert ctl.choose([1])[1] in (3, 4)   # the cheap rows, not the most tokens


def test_a_stalled_step_does_not_move_the_fit():
    m = StepCostModel(prior=0.05)
    feed(m, 60, a=0.100, c=0.015)
    m.observe(1, 0, 5.0)                              # the machine stalled for 5 s once
    assert abs(m.relative(1) - 0.15) < 0.01


def test_old_steps_leave_the_window():
    m = StepCostModel(prior=0.05, window=32)
    feed(m, 32, a=0.100, c=0.015)
    feed(m, 32, a=0.100, c=0.001, seed=1)             # the machine got faster at verification
    assert m.relative(1) < 0.02


def test_bad_observations_are_ignored():
    m = StepCostModel(prior=0.05)
    for bad in ((0, 1, 0.1), (1, -1, 0.1), (1, 1, 0.0), (1, 1, float("nan"))):
        m.observe(*bad)
    assert m.relative(1) == 0.05 and not m.measured


def measured_controller(c, f=0.0):
    ctl = SpecController(4, verify_cost=0.05)
    feed(ctl.cost, 64, a=0.100, c=c, f=f)
    return ctl


def test_measured_cost_turns_off_speculation_that_would_slow_decoding():
    # alpha ~0.3: worth drafting at the optimistic prior, not at a CPU's 20% per token + 10% per step.
    prior, cpu = SpecController(4, verify_cost=0.05), measured_controller(0.020, f=0.010)
    for ctl in (prior, cpu):
        for _ in range(30):
            ctl.observe(1, 3, 1)  # one accepted, then a rejection: alpha = 0.5 per trial
            ctl.observe(1, 3, 0)
    assert prior.choose([1])[1] > 0
    assert cpu.choose([1])[1] == 0
    assert abs(cpu.token_cost(1) - 0.30) < 0.01


def test_measured_cost_picks_a_shorter_k():
    cheap, dear = measured_controller(0.001), measured_controller(0.030)
    for ctl in (cheap, dear):
        for _ in range(30):
            ctl.observe(1, 2, 2)
            ctl.observe(1, 2, 1)   # alpha = 3/4
    assert cheap.choose([1])[1] == 4
    assert 1 <= dear.choose([1])[1] < 4


def test_fixed_cost_when_measuring_is_off():
    ctl = SpecController(4, verify_cost=0.05, measure_cost=False)
    feed(ctl.cost, 64, a=0.100, c=0.030)
    assert ctl.token_cost(1) == 0.05


def test_a_step_with_no_decoding_sequence_chooses_nothing():
    ctl = measured_controller(0.015, f=0.01)
    assert ctl.choose([]) == {}
    assert ctl.cost.relative(0) == ctl.cost.prior
