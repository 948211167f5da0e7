"""A draft node's front (`matinee serve --role draft`): each engine that attaches gets a draft
worker of its own on this node.

An engine sends AttachDraft with what the draft must agree on: its KV geometry (the draft's own
cache is addressed by the target's block tables) and its vocabulary. The service builds that
engine's proposer off the loop (a `draft` model loads its weights), checks the vocabulary, and
answers with the worker's ref; a restarted engine attaching again replaces its old worker.
`layerskip` shares the target's weights and KV, so it only runs inside the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.draft.config import SpeculativeConfig
from actors.draft.draft_actor import DraftWorkerActor, draft_model_proposer, ngram_proposer
from actors.draft.messages import AttachDraft, DraftAttached
from actors.draft.proposer import Proposer, vocab_digest
from runtime import Actor, ActorRef

REMOTE_METHODS = ("ngram", "draft")


def check_remote_method(spec: SpeculativeConfig) -> None:
    if spec.method not in REMOTE_METHODS:
        raise ValueError(f"a draft node serves {' or '.join(REMOTE_METHODS)}; {spec.method!r} shares the "
                         "target's weights and KV cache, so it runs inside the engine")


def build_node_proposer(spec: SpeculativeConfig, attach: AttachDraft, *, dtype: str = "float32",
                        kernels: str = "auto", device: str = "cpu", num_threads: int | None = None,
                        seed: int = 0) -> tuple[Proposer, float]:
    """The proposer for one attached engine, and a drafted token's cost prior (over a target step)."""
    check_remote_method(spec)
    if spec.method == "ngram":
        return ngram_proposer(spec)

    def check_vocab(draft) -> None:
        if draft.model_config.vocab_size != attach.vocab_size or vocab_digest(draft) != attach.vocab_digest:
            raise ValueError(f"the draft model's vocabulary ({draft.model_config.vocab_size} tokens) differs "
                             f"from engine {attach.engine_id}'s ({attach.vocab_size}); a draft model must use "
                             "the target's tokenizer")

    return draft_model_proposer(spec, attach.block_size, attach.num_blocks, max(attach.num_layers, 1),
                                max(attach.num_params, 1), check_vocab, dtype=dtype, kernels=kernels,
                                device=device, num_threads=num_threads, seed=seed)


class DraftService(Actor):
    def __init__(self, spec: SpeculativeConfig, **proposer_options: Any):
        check_remote_method(spec)
        self.spec = spec
        self.options = proposer_options
        self.workers: dict[str, ActorRef] = {}
        self._attached = 0

    async def receive(self, msg: Any) -> Any:
        match msg:
            case AttachDraft():
                return await self._attach(msg)
        return await super().receive(msg)

    async def _attach(self, msg: AttachDraft) -> DraftAttached:
        old = self.workers.pop(msg.engine_id, None)
        if old is not None:
            await self.context.system.stop(old)
        loop = asyncio.get_running_loop()
        try:
            built = await loop.run_in_executor(None, lambda: build_node_proposer(self.spec, msg, **self.options))
        except Exception as e:  # a wrong vocabulary, a missing model: the engine says why
            self.context.log.warning("draft refused", engine_id=msg.engine_id, error=str(e))
            return DraftAttached(None, error=str(e))
        self._attached += 1
        worker = await self.context.spawn(DraftWorkerActor(lambda: built), name=f"draft-{self._attached}")
        self.workers[msg.engine_id] = worker
        self.context.log.info("draft attached", engine_id=msg.engine_id, method=self.spec.method)
        return DraftAttached(worker, built[1])
