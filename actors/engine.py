"""Starts and stops one engine: the model worker, the KV manager and the scheduler as three actors.

`start_engine` returns an `Engine` handle; front ends (the gateway, the offline LLM) talk only to
`engine.scheduler` with SubmitRequest / AbortRequest / GetStats and receive TokenDeltas.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from actors.config import EngineConfig
from actors.draft.controller import SpecController
from actors.nodes.engine_ranks import on_rank_exit, runner_kwargs, start_ranks
from actors.draft.draft_actor import DraftWorkerActor, build_proposer, count_params
from actors.draft.draft_link import AttachNow, DraftLink
from actors.draft.messages import AttachDraft, DraftStats, GetDraftStats
from actors.draft.proposer import vocab_digest
from actors.kv.kv_actor import KVManagerActor
from actors.kv.structs import KVCacheConfig
from actors.kv.tier import KVTier
from actors.kv.tier_codec import Int8BlockCodec
from actors.kv.tier_disk import DiskTier
from actors.messages.front_end import LoadLoRAAdapter, LoRAOutcome
from actors.messages.step import GetWorkerInfo, WorkerInfo
from actors.scheduler.config import SchedulerConfig
from actors.scheduler.scheduler_actor import SchedulerActor
from actors.text.tokenizer import Tokenizer, load_tokenizer
from actors.model.config import ModelConfig
from actors.worker.decode_burst import BurstBrake
from actors.worker.kv_blocks import KVBlockIO
from actors.worker.model_runner import ModelRunner
from actors.worker.rank_processes import RankProcesses
from actors.worker.tensor_parallel import RankSpec
from actors.worker.worker_actor import WorkerActor, build_runner, compute_thread
from prefix_store.hashing import HASH_SCHEME
from runtime import ActorRef, ActorSystem, get_logger

log = get_logger(component="engine")


@dataclass
class Engine:
    config: EngineConfig
    system: ActorSystem
    scheduler: ActorRef
    kv: ActorRef
    worker: ActorRef
    tokenizer: Tokenizer
    model_config: ModelConfig
    num_blocks: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    scheduler_actor: SchedulerActor
    owns_system: bool = False
    draft: ActorRef | None = None     # the draft worker, with speculative decoding
    kv_blocks: KVBlockIO | None = None   # the cache's blocks as bytes, for a KV handoff
    kv_tier: KVTier | None = None        # where the KV manager keeps evicted blocks (--kv-offload-*)
    ranks: RankProcesses | None = None   # the tensor-parallel ranks past 0 this node started

    async def stop(self) -> None:
        """Scheduler first (no new steps), then the draft and target workers and the KV manager."""
        for ref in (self.scheduler, self.draft, self.worker, self.kv):
            if ref is not None and ref.is_alive:
                await self.system.stop(ref)
        if self.ranks is not None:   # the worker stopped them: they leave by themselves
            await asyncio.to_thread(self.ranks.stop)
        if self.kv_tier is not None:
            await asyncio.to_thread(self.kv_tier.close)
        gc.unfreeze()   # what it loaded can be collected again
        if self.owns_system:
            await self.system.shutdown()


async def start_engine(config: EngineConfig | None = None, system: ActorSystem | None = None, *,
                       name: str = "engine", **overrides: Any) -> Engine:
    """Loads the model and spawns the engine's actors in `system` (a new one when None).

    Actor names are `{name}-worker`, `{name}-kv` and `{name}-scheduler`, and `{name}-draft` with
    speculative decoding.
    """
    config = config or EngineConfig(**overrides)
    owns = system is None
    if system is None:
        system = ActorSystem(name)
    await system.start()
    tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, config.tokenizer or config.model))
    spawned: list[ActorRef] = []
    ranks, rank0 = start_ranks(config)
    try:
        executor = compute_thread()
        try:
            runner = await build_runner(lambda: _make_runner(config, rank0), executor)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        if ranks is not None:
            ranks.watch(on_rank_exit(system, ranks))
        brake = BurstBrake()   # the scheduler's, to end the worker's decode bursts early
        worker_actor = WorkerActor(runner, executor, seed=config.seed, brake=brake)
        worker = await system.spawn(worker_actor, name=f"{name}-worker")
        spawned.append(worker)
        info: WorkerInfo = await worker.ask(GetWorkerInfo())
        max_model_len = config.context_len(info.max_model_len, info.num_blocks)
        log.info("KV pool", blocks=info.num_blocks, block_size=info.block_size,
                 token_capacity=info.num_blocks * info.block_size, kv_cache_dtype=info.kv_cache_dtype,
                 kv_bytes_per_token=info.kv_bytes_per_token)
        kv_blocks = KVBlockIO(worker_actor.runner.kv_caches)
        # A disk tier's start lists and checks its directory: a thread's work, not the event loop's.
        kv_tier = await asyncio.to_thread(_open_tier, config, kv_blocks, info.block_size)
        # A tensor-parallel rank 0 holds only its KV heads: no blocks to give a peer engine.
        kv_actor = KVManagerActor(KVCacheConfig(info.num_blocks, info.block_size, config.enable_prefix_caching),
                                  kv_tier, kv_blocks if rank0 is None else None)
        kv = await system.spawn(kv_actor, name=f"{name}-kv")
        spawned.append(kv)
        tokenizer = await tokenizer_task
        worker_actor.runner.tokenizer = tokenizer   # a draft's vocabulary check reads it: not loaded twice
        eos = frozenset(info.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        scheduler_config = SchedulerConfig(config.max_num_seqs, config.step_tokens(), info.block_size,
                              max_model_len, eos, config.scheduling_policy == "priority", config.decode_burst,
                              config.ballast_objective(), config.lora_slots)
        draft, spec = None, None
        if config.speculative is not None:
            draft, spec = await _start_draft(config, system, name, worker_actor.runner)
            spawned.append(draft)
        scheduler_actor = SchedulerActor(scheduler_config, kv, worker, config.step_timeout_s, draft, spec,
                                         weight_bytes=info.weight_bytes, kv_bytes_per_token=info.kv_bytes_per_token,
                                         brake=brake)
        scheduler = await system.spawn(scheduler_actor, name=f"{name}-scheduler")
        spawned.append(scheduler)
        await _load_loras(scheduler, config.lora_paths())
    except BaseException:
        tokenizer_task.cancel()
        for ref in spawned:
            await system.stop(ref)
        if ranks is not None:
            await asyncio.to_thread(ranks.kill)
        if owns:
            await system.shutdown()
        raise
    freeze_heap()
    return Engine(config, system, scheduler, kv, worker, tokenizer, worker_actor.runner.model_config,
                  info.num_blocks, max_model_len, eos, scheduler_actor, owns, draft, kv_blocks, kv_tier, ranks)


def _open_tier(config: EngineConfig, blocks: KVBlockIO, block_size: int) -> KVTier | None:
    """The KV tier the flags ask for, or None. A disk tier's directory keeps its blocks only when it was
    written with this identity: model files, dtype, KV layout (K/V dtype and shapes), block size, hashing."""
    if not (config.kv_offload_memory or config.kv_offload_dir) or not config.enable_prefix_caching:
        return None
    disk = None
    codec = Int8BlockCodec(blocks.tensors) if config.kv_offload_dtype == "int8" else None
    if config.kv_offload_dir:
        identity = {"format": 1, "model": model_fingerprint(config.model), "dtype": config.resolved_dtype(),
                    "kv_layout": blocks.layout, "block_size": block_size, "block_hash": HASH_SCHEME}
        if codec is not None:   # a directory of the pool's own bytes is not one of int8 blocks
            identity["tier_dtype"] = config.kv_offload_dtype
        disk = DiskTier(config.kv_offload_dir, identity, config.kv_offload_disk)
        log.info("disk KV tier", path=config.kv_offload_dir, blocks=len(disk), bytes=disk.bytes_used,
                 emptied=disk.reset_reason)
    return KVTier(blocks, config.kv_offload_memory, disk, codec)


def model_fingerprint(path: str) -> str:
    """The model's files by name, size and modification time: other weights, another fingerprint."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    digest = hashlib.sha256()
    for name in files:
        st = os.stat(name)
        digest.update(f"{os.path.relpath(name, path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return f"{os.path.abspath(path)}#{digest.hexdigest()[:16]}"


def freeze_heap() -> None:
    """The objects alive after loading (torch, the model, the tokenizer: ~250k) leave the collector's
    generations: a full collection walked them all, a 136 ms pause in the middle of a prefill, and
    serving only ever adds to them. The garbage of earlier engines in this process is collected first."""
    gc.collect()
    gc.freeze()
    log.info("heap frozen", objects=gc.get_freeze_count())


async def _start_draft(config: EngineConfig, system: ActorSystem, name: str,
                       target: ModelRunner) -> tuple[ActorRef, SpecController]:
    """The draft worker (its proposer built on its own thread) and the scheduler's controller."""
    spec = config.speculative
    spec.check_against_target(target.model_config.num_layers)

    if spec.draft_node is not None:
        draft = await _attach_draft_node(spec.draft_node, system, name, target)
    else:
        def make():
            return build_proposer(spec, target, dtype=config.resolved_dtype(), kernels=config.kernels,
                                  device=config.resolved_device(), num_threads=config.num_threads,
                                  seed=config.seed)

        draft = await system.spawn(DraftWorkerActor(make), name=f"{name}-draft")
    stats: DraftStats = await draft.ask(GetDraftStats())
    controller = SpecController(spec.num_speculative_tokens, disable_batch_size=spec.disable_batch_size,
                                adaptive=spec.adaptive, draft_cost=stats.draft_cost,
                                verify_cost=spec.verify_cost, probe_interval=spec.probe_interval,
                                measure_cost=spec.measure_cost)
    return draft, controller


async def _attach_draft_node(node_id: str, system: ActorSystem, name: str, target: ModelRunner) -> ActorRef:
    """A link to this engine's draft worker on a draft node. A node that refuses (another
    vocabulary) stops the start with its reason; one not up yet is attached to when it comes."""
    cfg = target.model_config
    attach = AttachDraft(f"{system.name}/{name}", target.block_size, target.num_blocks, cfg.vocab_size,
                         vocab_digest(target), cfg.num_layers, count_params(target))
    link = await system.spawn(DraftLink(node_id, attach), name=f"{name}-draft")
    outcome = await link.ask(AttachNow(), timeout=600)
    if outcome == "unreachable":
        log.warning("draft node not reachable yet; decoding without drafts until it is", node=node_id)
    elif outcome:
        await system.stop(link)
        raise ValueError(f"speculative draft node {node_id!r}: {outcome}")
    return link


async def _load_loras(scheduler: ActorRef, paths: dict[str, str]) -> None:
    """--lora-modules, through the scheduler as the load API's adapters go: an adapter that cannot be served
    stops the start with its reason."""
    for name, path in paths.items():
        outcome: LoRAOutcome = await scheduler.ask(LoadLoRAAdapter(name, path), timeout=600)
        if outcome.error:
            raise ValueError(f"--lora-modules {name}={path}: {outcome.error}")


def _make_runner(config: EngineConfig, rank0: RankSpec | None = None) -> ModelRunner:
    return ModelRunner(**runner_kwargs(config), tensor_parallel=rank0)
