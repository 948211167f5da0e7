"""One request in flight across a cluster: which engine runs which of its samples, what each
sample generated so far, and how to continue it elsewhere when that engine dies. A part being
prefilled for a decode engine involves both: it is lost when either dies before the handover.

Pure and synchronous. A continuation is the prompt plus the sample's tokens so far, submitted
under a new engine request id, so stray deltas from the lost engine can never be mistaken for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from actors.messages.front_end import SamplingParams, TokenDelta


@dataclass
class Part:
    """One engine request: all samples of the request (`index` None) or one continued sample."""

    engine_id: str
    index: int | None
    decode: str | None = None   # the decode engine its KV goes to, until it is handed over


@dataclass
class Resubmission:
    engine_request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class InflightRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    generated: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    parts: dict[str, Part] = field(default_factory=dict)
    migrations: int = 0
    resubmits: int = 0          # continuations made, for their engine request ids
    num_cached_tokens: int | None = None
    aborted: bool = False
    ballast: bool = False       # a batch line (scheduled below interactive requests)

    def __post_init__(self) -> None:
        n = self.params.n
        self.generated = [[] for _ in range(n)]
        self.done = [False] * n

    @property
    def finished(self) -> bool:
        return self.aborted or all(self.done)

    def place(self, engine_id: str, decode: str | None = None) -> str:
        """The first submission: every sample on one engine, under the request's own id."""
        self.parts[self.request_id] = Part(engine_id, None, decode)
        return self.request_id

    def hand_over(self, engine_request_id: str) -> bool:
        """The part's decode engine took it over; False when the request no longer has the part."""
        part = self.parts.get(engine_request_id)
        if part is None or part.decode is None:
            return False
        part.engine_id, part.decode = part.decode, None
        return True

    def on_delta(self, engine_request_id: str, d: TokenDelta) -> TokenDelta | None:
        """The delta as the client sees it (its sample index, the original prompt's length),
        or None for a delta of a part this request no longer has."""
        part = self.parts.get(engine_request_id)
        if part is None:
            return None
        index = d.index if part.index is None else part.index
        if index >= len(self.done) or self.done[index]:
            return None
        self.generated[index].extend(d.token_ids)
        if self.num_cached_tokens is None:
            self.num_cached_tokens = d.num_cached_tokens
        if d.finish_reason is not None:
            self.done[index] = True
            if part.index is not None or all(self.done):
                self.parts.pop(engine_request_id, None)
        return msgspec.structs.replace(d, request_id=self.request_id, index=index,
                                       num_prompt_tokens=len(self.prompt_token_ids),
                                       num_cached_tokens=self.num_cached_tokens)

    def abort_targets(self, index: int | None) -> list[tuple[str, str, int | None]]:
        """(engine id, engine request id, sample index or None) to abort for `index` (None: all)."""
        out = []
        for rid, part in list(self.parts.items()):
            if index is None:
                out.append((part.engine_id, rid, None))
            elif part.index == index:
                out.append((part.engine_id, rid, None))
            elif part.index is None:
                out.append((part.engine_id, rid, index))
        if index is None:
            self.aborted = True
            self.parts.clear()
        else:
            self.done[index] = True
            for _, rid, i in out:
                if i is None:
                    self.parts.pop(rid, None)
        return out

    def engines(self) -> set[str]:
        return {p.engine_id for p in self.parts.values()} | {p.decode for p in self.parts.values() if p.decode}

    def lose_engine(self, engine_id: str) -> list[int]:
        """Forget the parts on a dead engine; the unfinished samples they carried, in order."""
        lost: list[int] = []
        for rid, part in list(self.parts.items()):
            if engine_id not in (part.engine_id, part.decode):
                continue
            del self.parts[rid]
            indices = range(len(self.done)) if part.index is None else [part.index]
            lost += [i for i in indices if not self.done[i]]
        return sorted(set(lost))

    def continuation(self, index: int) -> Resubmission | None:
        """How sample `index` goes on elsewhere; None when it has no tokens left to make."""
        made = self.generated[index]
        params = msgspec.structs.replace(self.params, n=1)
        if params.max_tokens is not None:
            left = params.max_tokens - len(made)
            if left <= 0:
                return None
            params = msgspec.structs.replace(params, max_tokens=left)
        self.resubmits += 1
        return Resubmission(f"{self.request_id}@{self.resubmits}.{index}", index,
                            self.prompt_token_ids + made, params)

    def place_continuation(self, r: Resubmission, engine_id: str, decode: str | None = None) -> None:
        self.parts[r.engine_request_id] = Part(engine_id, r.index, decode)

    def finish_locally(self, index: int, reason: str) -> TokenDelta:
        """End a sample without an engine (its token budget ran out as its engine died)."""
        self.done[index] = True
        return TokenDelta(self.request_id, index, [], None, reason, len(self.prompt_token_ids),
                          self.num_cached_tokens or 0)
