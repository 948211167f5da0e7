"""An engine's tensor-parallel ranks, as the flags place them: which ranks a node runs and on which cores,
starting those past rank 0 as child processes, a node that runs ranks alone (--node-rank above 0), and
what a lost rank does to the engine (stops its node).
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from actors.config import EngineConfig
from actors.worker.rank_processes import RankProcesses
from actors.worker.tensor_parallel import RankSpec
from runtime import ActorSystem, get_logger

log = get_logger(component="engine")


def runner_kwargs(config: EngineConfig) -> dict[str, Any]:
    """ModelRunner's arguments, the same for every tensor-parallel rank (JSON for the rank processes)."""
    num_threads = config.num_threads
    if num_threads is None and config.ranks_per_node > 1:   # the node's cores, shared by its ranks
        num_threads = max(1, len(os.sched_getaffinity(0)) // config.ranks_per_node)
    return dict(model=config.model, dtype=config.resolved_dtype(), kernels=config.kernels,
                block_size=config.block_size, num_blocks=config.num_blocks,
                kv_cache_memory=config.kv_cache_memory, device=config.resolved_device(),
                num_threads=num_threads, quantization=config.quantization,
                kv_cache_dtype=config.kv_cache_dtype,
                cuda_graph_batch=0 if config.enforce_eager else config.max_num_seqs,
                max_loras=config.lora_slots, max_lora_rank=config.max_lora_rank,
                batch_invariant=config.batch_invariant)


def rank_specs(config: EngineConfig) -> list[RankSpec]:
    """The tensor-parallel ranks this node runs (node n: ranks n*k .. n*k+k-1 of k a node), on the CPU each
    on its own group of the cores this process may use."""
    port = config.master_port if config.master_port is not None else free_port(config.master_addr)
    per_node = config.ranks_per_node
    groups = _core_groups(per_node) if config.resolved_device() == "cpu" else [[]] * per_node
    first = config.node_rank * per_node
    all_reduce = "gloo" if config.nnodes > 1 else config.tp_all_reduce   # shared memory spans one host
    return [RankSpec(first + i, config.tensor_parallel_size, config.master_addr, port, config.step_timeout_s,
                     groups[i], all_reduce) for i in range(per_node)]


def _core_groups(n: int) -> list[list[int]]:
    """The usable cores in `n` contiguous groups (a socket's cores are numbered together); none where there
    are fewer cores than groups."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        return [[]] * n
    return [cores[i * len(cores) // n:(i + 1) * len(cores) // n] for i in range(n)]


def start_ranks(config: EngineConfig) -> tuple[RankProcesses | None, RankSpec | None]:
    """Under tensor parallelism: this node's ranks past 0 as child processes, and rank 0's own spec."""
    if config.tensor_parallel_size == 1:
        return None, None
    if config.node_rank != 0:
        raise ValueError("the engine runs on node 0; a node of --node-rank above 0 runs its ranks alone "
                         "(serve_ranks)")
    specs = rank_specs(config)
    others = RankProcesses(specs[1:], runner_kwargs(config), config.resolved_device(),
                           config.ranks_per_node) if specs[1:] else None
    return others, specs[0]


def serve_ranks(config: EngineConfig) -> int:
    """A node of --node-rank above 0: runs its tensor-parallel ranks until they end (rank 0, on node 0,
    stops them with the engine); the first failing rank's status."""
    ranks = RankProcesses(rank_specs(config), runner_kwargs(config), config.resolved_device(), config.ranks_per_node)
    try:
        return ranks.wait()
    finally:
        ranks.kill()


def on_rank_exit(system: ActorSystem, ranks: RankProcesses):
    """A rank that ends while the engine serves fails the engine: the other ranks are ended and the node
    stops (exit status 1), so the cluster moves its streams to another engine; the step in flight, and any
    after it, fail at once (the group's collectives fail) rather than wait on the lost rank."""
    loop = asyncio.get_running_loop()

    def on_exit(rank: int, status: int) -> None:
        log.critical("tensor-parallel rank lost; stopping the engine", rank=rank, status=status)
        ranks.kill()
        loop.call_soon_threadsafe(system.request_shutdown, 1)

    return on_exit


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
