"""Pulling a prompt's prefix from a peer engine: the blocks it holds and this engine lacks are copied
into this engine's KV tier before the request is scheduled, and the admission copies them in from there.

The transfer actor runs both ends over the cluster transport (sealed frames, `KVPull` / `KVPulled`), in
chunks of `chunk_bytes`, as a handoff's blocks go, and only between engines whose KV layout is the same.
The hashes carry the tenant's salt and the LoRA adapter, as the scheduler's do, so a peer only ever
gives blocks the request could have computed.
Whatever goes wrong (the peer dies, refuses, is slow past `timeout_s`), the request is scheduled all the
same and computes what was not pulled: a pull only ever saves time.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from actors.messages.front_end import SubmitRequest
from actors.messages.handoff import KVPull, KVPulled, PrefixPullTimed
from actors.messages.kv import KVHeldRun, KVTierPut
from prefix_store.hashing import adapter_salt, hash_full_blocks
from runtime import ActorRef, get_logger

log = get_logger(component="prefix-pull")


class PrefixPull:
    def __init__(self, kv: ActorRef, scheduler: ActorRef, layout: str, block_size: int, bytes_per_block: int,
                 chunk_bytes: int, timeout_s: float):
        self.kv = kv
        self.scheduler = scheduler
        self.layout = layout
        self.block_size = block_size
        self.blocks_per_ask = max(1, chunk_bytes // bytes_per_block)
        self.timeout_s = timeout_s

    async def pull_then_submit(self, submit: SubmitRequest) -> None:
        """Pull what the peer has, put it in the tier (with how the pull went), then hand the request
        to the scheduler: always, once, and after the KV manager has the blocks."""
        started = time.perf_counter()
        hashes: list[bytes] = []
        blocks: list[bytes] = []
        failed = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._pull(submit, hashes, blocks)
        except Exception as exc:   # the prefill it would have saved is computed instead
            failed = True
            log.info("prefix pull failed; computing the rest of the prompt", request_id=submit.request_id,
                     pulled_blocks=len(blocks), error=str(exc) or repr(exc))
        finally:
            seconds = time.perf_counter() - started
            self.kv.tell(KVTierPut(hashes, blocks, seconds, failed))
            self.scheduler.tell(PrefixPullTimed(sum(len(b) for b in blocks), seconds, submit.pull_from.node))
            self.scheduler.tell(msgspec.structs.replace(submit, pull_from=None))

    async def serve(self, pull: KVPull) -> KVPulled:
        """A peer's ask: the leading blocks this engine can give, in a layout the peer can write."""
        if pull.block_layout != self.layout:
            return KVPulled([])
        return await self.kv.ask(pull, timeout=self.timeout_s)

    async def _pull(self, submit: SubmitRequest, hashes: list[bytes], blocks: list[bytes]) -> None:
        """Into `hashes` and `blocks`: the leading run of the prompt's blocks this engine lacks that the
        peer gives, chunk by chunk (what came before a failure is kept)."""
        prompt = submit.prompt_token_ids
        wanted = hash_full_blocks(prompt, self.block_size,
                                  adapter_salt(submit.cache_salt, submit.lora_name, submit.lora_key),
                                  limit=max(len(prompt) - 1, 0) // self.block_size)
        held = await self.kv.ask(KVHeldRun(wanted), timeout=self.timeout_s)
        wanted = wanted[held:]
        for at in range(0, len(wanted), self.blocks_per_ask):
            ask = wanted[at:at + self.blocks_per_ask]
            reply: KVPulled = await submit.pull_from.ask(KVPull(ask, self.layout), timeout=self.timeout_s)
            hashes += ask[:len(reply.blocks)]
            blocks += reply.blocks
            if len(reply.blocks) < len(ask):
                return
