"""Whether a prefix pull from a peer engine beats computing the prefix here: a block's bytes over the
measured link rate against its tokens over the measured prefill rate.

Both rates are smoothed measurements of this engine: the prefill rate from its own steps that
prefilled (tokens per second of forward), the link rate from its completed pulls (bytes per second,
asks and round trips included), one per peer: a peer on this host and one across the world are
different links. Until both rates are measured for a peer, a pulled block is assumed to cost what a
block copied back from the tier does, an eighth of computing it (so the engine pulls). A pull from a
peer judged too slow is skipped, but every `probe_every`-th one goes ahead all the same, so a link
that got faster is measured again. Pure bookkeeping: the scheduler actor feeds it and asks it.
"""

from __future__ import annotations

from actors.kv.kv_actor import RELOADED_PER_BUDGET_TOKEN


class RateMeter:
    """An exponentially smoothed rate (amount per second); None until the first measurement."""

    def __init__(self, weight: float = 0.25):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"a rate's smoothing weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.rate: float | None = None
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        """`amount` done in `seconds`; nothing done or no time taken measures nothing."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.rate = rate if self.rate is None else self.rate + self.weight * (rate - self.rate)
        self.samples += 1


class PullCost:
    def __init__(self, block_size: int, bytes_per_block: int, probe_every: int = 16):
        if block_size < 1 or bytes_per_block < 1:
            raise ValueError(f"a block of {block_size} tokens and {bytes_per_block} bytes cannot be priced")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.probe_every = probe_every
        self.prefill = RateMeter()   # tokens a second
        self.link = RateMeter()      # bytes a second, every peer's pulls (for the stats)
        self.links: dict[str, RateMeter] = {}   # bytes a second, by peer (what decides)
        self._skipped: dict[str, int] = {}      # by peer: pulls skipped since the last that went ahead
        self.skipped = 0             # in all

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` prompt tokens in a forward of `seconds`."""
        self.prefill.observe(tokens, seconds)

    def pulled(self, num_bytes: int, seconds: float, peer: str = "") -> None:
        """A pull from `peer` moved `num_bytes` in `seconds` (one that moved nothing measures nothing)."""
        self.link.observe(num_bytes, seconds)
        self.links.setdefault(peer, RateMeter()).observe(num_bytes, seconds)

    def block_ratio(self, peer: str = "") -> float:
        """Seconds to pull a block from `peer` over seconds to compute it: measured, or the starting
        assumption."""
        link = self.links.get(peer)
        if self.prefill.rate is None or link is None or link.rate is None:
            return 1.0 / RELOADED_PER_BUDGET_TOKEN
        return (self.bytes_per_block / link.rate) / (self.block_size / self.prefill.rate)

    def should_pull(self, peer: str = "") -> bool:
        """Decide for one request that `peer` could give a prefix to; a skip counts towards that
        peer's next probe."""
        skipped = self._skipped.get(peer, 0)
        if self.block_ratio(peer) < 1.0 or skipped + 1 >= self.probe_every:
            self._skipped[peer] = 0
            return True
        self._skipped[peer] = skipped + 1
        self.skipped += 1
        return False
