"""Adaptive speculation: how many tokens to draft for each decoding sequence in the next step.

A plain synchronous class. It estimates each sequence's per-token acceptance rate alpha (an
exponentially decayed count of accepted drafts over accepted drafts plus rejections, starting from
the engine's recent acceptance over all sequences, or the configured prior before any) and picks
the k that maximises the step's tokens per unit of its time. A step of n decoding sequences emits n
tokens in time T; when one of them drafts k, it emits n - 1 + E(k) with E(k) = (1 - alpha^(k+1)) /
(1 - alpha), in T * (1 + cost * k), where cost, one drafted token's share of that plain step, is
learned from the measured step times (StepCostModel; draft_cost + verify_cost is its prior). The
drafts slow every sequence in the step, so the larger the batch, the higher the acceptance a
sequence needs to draft at all. A sequence for which no k beats plain decoding stops speculating
and tries k=1 again after `probe_interval` steps (then twice as long after each failed probe, up
to 16 times; a new sequence that starts switched off waits as long as the engine's last failed
probe did), in a step where a draft all of whose tokens were accepted would pay; above
`disable_batch_size` decoding sequences nobody speculates, so speculation never makes serving
slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.draft.step_cost import StepCostModel

ENGINE_DECAY = 0.98   # per verification, for the engine-wide acceptance that new sequences start from
CLEAR_GAIN = 1.02     # a draft must beat plain decoding by this much: measurement noise should not flip it on


@dataclass
class _SeqStats:
    successes: float
    trials: float
    off_steps: int = 0
    interval: int = 0      # steps between probes while off; doubles after each probe that fails
    probing: bool = False  # its last k was a probe
    verified: bool = False # it has had a verification of its own


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits on average: accepted drafts plus the corrected/bonus one."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecController:
    def __init__(self, max_k: int, *, disable_batch_size: int | None = None, adaptive: bool = True,
                 draft_cost: float = 0.0, verify_cost: float = 0.05, probe_interval: int = 16,
                 prior_alpha: float = 0.7, prior_weight: float = 2.0, decay: float = 0.9,
                 measure_cost: bool = True) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0:
            raise ValueError("decay must be in (0, 1], prior_alpha in [0, 1], prior_weight positive")
        self.max_k = max_k
        self.disable_batch_size = disable_batch_size
        self.adaptive = adaptive
        self.cost = StepCostModel(draft_cost + verify_cost)
        self.measure_cost = measure_cost
        self.probe_interval = probe_interval
        self.prior_weight = prior_weight
        self.decay = decay
        self._seqs: dict[int, _SeqStats] = {}
        # The engine's recent acceptance over all sequences: where a new sequence starts. It begins
        # at the configured prior and forgets more slowly than a sequence's own estimate.
        self._engine = _SeqStats(prior_alpha * prior_weight, prior_weight)
        self.engine_decay = ENGINE_DECAY
        # How long a sequence that starts switched off waits before its first probe: the interval
        # the last failed probe reached, so that request after request of a draft that never agrees
        # (layer-skip on SmolLM2: each probe ~0.4 of a step) does not restart the back-off at
        # probe_interval; a probe that is accepted resets it.
        self._engine_interval = 0

    def alpha(self, seq_id: int) -> float:
        s = self._stats(seq_id)
        return s.successes / s.trials

    def choose(self, seq_ids: list[int]) -> dict[int, int]:
        """k for each of the step's decoding sequences (0: decode plainly)."""
        if not seq_ids:
            return {}
        if self.disable_batch_size is not None and len(seq_ids) > self.disable_batch_size:
            return {sid: 0 for sid in seq_ids}
        if not self.adaptive:
            return {sid: self.max_k for sid in seq_ids}
        n = len(seq_ids)
        costs = [0.0] + [k * self.token_cost(n, k) for k in range(1, self.max_k + 1)]
        # A switched-off sequence probes only where a draft could pay at all: with every drafted
        # token accepted. (At batch 16 on a CPU, a layer-skip probe costs a sixth of the step.)
        may_probe = any(n + k > n * (1.0 + costs[k]) * CLEAR_GAIN for k in range(1, self.max_k + 1))
        return {sid: self._choose_one(sid, n, costs, may_probe) for sid in seq_ids}

    def token_cost(self, num_seqs: int, k: int = 1) -> float:
        """Per drafted token, over a plain decode step of `num_seqs` sequences, when one of them
        drafts k: the dearer of two prices, that sequence drafting alone (it pays what a step pays
        once for drafting at all, by itself: at batch 16 on a CPU ~8 ms of a 175 ms step, as much as
        a drafted row) and every sequence drafting k (the rows add up, and on a CPU grow dearer)."""
        if not self.measure_cost:
            return self.cost.prior
        return max(self.cost.relative(num_seqs, k, drafting=1), self.cost.relative(num_seqs, k))

    def observe_step(self, num_seqs: int, num_drafted: int, seconds: float) -> None:
        """A pure-decode step's wall time, `num_drafted` drafted tokens verified over `num_seqs` sequences."""
        self.cost.observe(num_seqs, num_drafted, seconds)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """One verification of `num_drafted` tokens, of which the first `num_accepted` were kept."""
        if num_drafted <= 0:
            return
        s = self._stats(seq_id)
        s.verified = True
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        for stats, decay in ((s, self.decay), (self._engine, self.engine_decay)):
            stats.successes = decay * stats.successes + num_accepted
            stats.trials = decay * stats.trials + num_accepted + rejected
        if s.trials <= 0:
            s.successes, s.trials = self._new_seq_prior()
        if s.probing:
            s.probing = False
            self._engine_interval = 0 if num_accepted else max(self._engine_interval, s.interval)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)

    def _stats(self, seq_id: int) -> _SeqStats:
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _SeqStats(*self._new_seq_prior())
        return s

    def _new_seq_prior(self) -> tuple[float, float]:
        """A new sequence starts from the engine's recent acceptance, weighted like the prior: with a
        draft that rarely agrees it starts switched off instead of wasting its first verifications."""
        e = self._engine
        alpha = e.successes / e.trials if e.trials > 0 else 0.0
        return alpha * self.prior_weight, self.prior_weight

    def _choose_one(self, seq_id: int, num_seqs: int, costs: list[float], may_probe: bool) -> int:
        """costs[k]: this sequence drafting k tokens, in plain decode steps of the batch (costs[0] = 0)."""
        s = self._stats(seq_id)
        alpha = s.successes / s.trials
        others = num_seqs - 1
        best_k, best_rate = 0, 1.0   # plain decoding: the step's tokens per its time, as a unit
        for k in range(1, self.max_k + 1):
            rate = (others + expected_tokens(alpha, k)) / (num_seqs * (1.0 + costs[k]))
            if rate > best_rate * CLEAR_GAIN:
                best_k, best_rate = k, rate
        if best_k == 0:
            # A sequence that drafted before (it was copying, say) probes soon; a new one that starts
            # switched off waits as long as the engine's last failed probe did.
            s.interval = s.interval or (self.probe_interval if s.verified else
                                        max(self.probe_interval, self._engine_interval))
            s.off_steps += 1
            if s.off_steps >= s.interval and may_probe:
                s.off_steps = 0
                s.interval = min(2 * s.interval, 16 * self.probe_interval)  # back off if it fails again
                s.probing = True
                return 1  # probe: acceptance may have changed (the text moved on to a quote, say)
            return 0
        s.off_steps = s.interval = 0
        return best_k
