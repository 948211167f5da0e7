"""One rank's end of a tensor-parallel model worker: the process group and the few collectives the
sharded forward needs (gloo on the CPU, NCCL on GPUs; on the CPU the all-reduces and the LM head's gather go
through shared memory instead where the ranks share a host: cpu_collectives.py chooses).

Rank 0 is the engine's model worker; it broadcasts each step's flattened batch (the plan) once, every rank
runs the forward on its shard, o_proj and down_proj outputs are summed by one all-reduce each, and the
LM head's vocabulary slices are gathered into whole logits. Each rank keeps the seconds it spent inside
the collectives (`all_reduce_s`, `collective_s`; rank 0's go into the engine's stats, for the share of a
step the split costs). A collective that fails (a rank died, or the
group's timeout passed) leaves the ranks out of step for good: every later call raises RanksLost at once,
and the engine stops (WorkerActor) instead of hanging.
"""
from __future__ import annotations

import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from actors.worker import cpu_collectives
from actors.worker.forward_batch import FlatBatch
from actors.worker.shard_plan import ShardPlan

_STOP, _FORWARD = 0, 1
_HEADER = 8   # op, tokens, sequences, block-table width, logits rows, pooled rows, max_query_len, max_seq_len


class RankSpec(msgspec.Struct, frozen=True):
    """Where one rank stands in the group; what the engine hands each rank process (JSON)."""
    rank: int
    size: int
    master_addr: str
    master_port: int
    timeout_s: float = 600.0
    cores: list[int] = []   # on the CPU, the core group its forward runs on (empty: wherever the process may)
    all_reduce: str = "auto"   # on the CPU: shm, gloo, or auto (shm where every rank maps it and it measures faster)


class RanksLost(RuntimeError):
    """A collective failed: some rank is gone (or out of step), and this worker cannot go on."""


class TensorParallel:
    def __init__(self, spec: RankSpec, plans: list[ShardPlan], device: torch.device) -> None:
        """Joins the group: returns once every rank has (or raises after spec.timeout_s)."""
        self.rank, self.size, self.device = spec.rank, spec.size, device
        self.plan = plans[spec.rank]
        self._vocab_sizes = [len(p.vocab) for p in plans]
        self.broken: str | None = None
        # Seconds inside the collectives, cumulative: the host clock around each call, so on the CPU (gloo
        # returns when the sum is done) the whole collective, waiting for the slowest rank included; on CUDA
        # NCCL's launch alone. On ranks past 0 the plan's broadcast also waits for rank 0's next step.
        self.all_reduce_s = 0.0   # the o/down projections' and the embedding's all-reduces
        self.collective_s = 0.0   # every collective: those, the LM head's gather and the plan's broadcasts
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)   # NCCL binds each rank's communicator to the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{spec.master_addr}:{spec.master_port}", rank=spec.rank,
                                world_size=spec.size, timeout=timedelta(seconds=spec.timeout_s))
        try:
            self._shm = None if device.type == "cuda" else cpu_collectives.choose(spec.all_reduce, spec.rank,
                                                                                   spec.size, spec.timeout_s)
        except BaseException:
            dist.destroy_process_group()
            raise
        self.all_reduce_via = "nccl" if device.type == "cuda" else "gloo" if self._shm is None else "shm"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums of a row-parallel projection, summed in place (through shared memory, the
        sum in rank order: every rank gets the same bits)."""
        shm = self._shm is not None and self._shm.takes(t)
        self._guarded(self._shm.all_reduce if shm else dist.all_reduce, t, all_reduce=True)
        return t

    def embedding(self, ops, input_ids: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows from vocabulary shards: each rank fills the rows of the ids it holds, zeros elsewhere,
        and the all-reduce adds them (exact: one rank's row plus zeros)."""
        local = input_ids - self.plan.vocab.start
        held = (local >= 0) & (local < len(self.plan.vocab))
        rows = ops.embedding(torch.where(held, local, 0), weight).to(dtype)
        return self.all_reduce(rows * held.unsqueeze(-1).to(dtype))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, this rank's vocabulary] -> [n, vocab] on every rank (slices padded to one width to gather)."""
        width = max(self._vocab_sizes)
        padded = logits.new_zeros(logits.shape[0], width)
        padded[:, :logits.shape[1]] = logits
        if self._shm is not None:
            parts = self._guarded(self._shm.all_gather, padded).unbind(0)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            self._guarded(dist.all_gather, parts, padded)
        return torch.cat([p[:, :n] for p, n in zip(parts, self._vocab_sizes)], dim=1)

    def send_plan(self, flat: FlatBatch) -> None:
        """Rank 0: the step's flattened batch to every other rank, as one header and one payload broadcast."""
        header = torch.tensor([_FORWARD, flat.input_ids.shape[0], flat.seq_lens.shape[0], flat.block_tables.shape[1],
                               flat.logits_indices.shape[0], flat.pool_indices.shape[0], flat.max_query_len,
                               flat.max_seq_len], dtype=torch.int64)
        payload = torch.cat([flat.input_ids, flat.positions, flat.slot_mapping, flat.query_start_loc.long(),
                             flat.seq_lens.long(), flat.block_tables.long().reshape(-1), flat.logits_indices,
                             flat.pool_indices])
        self._broadcast(header)
        self._broadcast(payload)

    def send_stop(self) -> None:
        """Rank 0: the other ranks leave their loops (and their processes end)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _STOP
        self._broadcast(header)

    def receive_plan(self) -> FlatBatch | None:
        """Ranks past 0: the next step's flattened batch, or None when rank 0 stops the group."""
        header = self._broadcast(torch.empty(_HEADER, dtype=torch.int64))
        op, t, b, width, n_logits, n_pool, max_query_len, max_seq_len = header.tolist()
        if op == _STOP:
            return None
        sizes = [t, t, t, b + 1, b, b * width, n_logits, n_pool]
        payload = self._broadcast(torch.empty(sum(sizes), dtype=torch.int64))
        ids, pos, slots, starts, lens, tables, logits_rows, pool = payload.split(sizes)
        return FlatBatch(ids, pos, slots, starts.int(), lens.int(), tables.reshape(b, width).int(), logits_rows,
                         max_query_len, max_seq_len, pool)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast from rank 0 through the device NCCL needs; the CPU tensor back."""
        on = t.to(self.device)
        self._guarded(dist.broadcast, on, 0)
        return on.cpu() if on is not t else t

    def _guarded(self, collective, *args, all_reduce: bool = False):
        """collective(*args)'s result, timed; RanksLost for good once one has failed."""
        if self.broken is not None:
            raise RanksLost(self.broken)
        t0 = time.perf_counter()
        try:
            result = collective(*args)
        except (RuntimeError, dist.DistBackendError) as e:   # ShmFailure is a RuntimeError
            self.broken = f"tensor-parallel rank {self.rank} of {self.size}: a collective failed ({e})"
            raise RanksLost(self.broken) from e
        spent = time.perf_counter() - t0
        self.collective_s += spent
        if all_reduce:
            self.all_reduce_s += spent
        return result
