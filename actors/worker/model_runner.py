"""Owns the model and its paged KV cache; runs one forward step over a ForwardBatch.

Plain synchronous class: the worker actor calls `execute` from its compute thread. It knows
nothing of requests or sampling; it turns sequences into logits and records how long that took.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import structlog
import torch

from actors.model.memory_plan import kv_bytes_per_block
from actors.worker.allocator import keep_freed_memory
from actors.worker.decode_graphs import DecodeGraphs
from actors.worker.pinned_batch import PinnedBatch
from actors.worker.lora_slots import LoRABatch, LoRASlots
from actors.worker.pooling import read_pooling
from actors.model.config import ModelConfig
from actors.worker.forward_batch import DecodeCursor, FlatBatch, ForwardBatch, flatten
from actors.worker.gguf_weights import GGUFWeights
from actors.worker.awq_weights import AWQConfig, AWQWeights
from actors.worker.gptq_weights import GPTQConfig, GPTQWeights
from actors.worker.hf_weights import HFWeights
from actors.model.config import read_hf_config
from actors.worker.model import AttentionMetadata, DecoderModel, LayerKV, why_dequantized
from actors.model.source import ModelSource, resolve_model_source
from actors.worker.shard_plan import plan_shards
from actors.worker.sharded_weights import ShardedWeights
from actors.worker.tensor_parallel import RankSpec, TensorParallel
from kernels import get_ops, lora_cpu
from kernels.kv_quant import QUANTIZED_DTYPES, is_quantized

DEFAULT_KV_CACHE_MEMORY = 1 << 30   # bytes, when neither num_blocks nor kv_cache_memory is given

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}   # and "auto": the model dtype


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r} (auto, {', '.join(KV_CACHE_DTYPES)})")
    return KV_CACHE_DTYPES[name]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)")


def open_model(source: ModelSource):
    """(ModelConfig, weights) for a resolved source; weights.get(hf_name, dtype) -> tensor."""
    if source.kind == "gguf":
        weights = GGUFWeights(source.path)
        return weights.config, weights
    if AWQConfig.from_folder(source.path) is not None:
        return read_hf_config(source.path), AWQWeights(source.path)
    if GPTQConfig.from_folder(source.path) is not None:   # refuses any other quantization_config
        return read_hf_config(source.path), GPTQWeights(source.path)
    return read_hf_config(source.path), HFWeights(source.path)


class ModelRunner:
    def __init__(self, model: str | None = None, dtype: str | torch.dtype = "float32", kernels: str = "auto",
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 device: str | torch.device = "cpu", num_threads: int | None = None,
                 quantization: str = "none", kv_cache_dtype: str = "auto", cuda_graph_batch: int = 0,
                 max_loras: int = 0, max_lora_rank: int = 16, tensor_parallel: RankSpec | None = None,
                 batch_invariant: bool = False) -> None:
        """cuda_graph_batch: on CUDA with the Triton kernels, decode steps of up to this many sequences
        replay CUDA graphs captured here (decode_graphs.py); 0 runs every step eagerly. max_loras: slots
        for LoRA adapters of up to max_lora_rank (lora_slots.py); 0 serves the base model alone.
        tensor_parallel: this runner is that rank of a model split across processes (tensor_parallel.py); it
        loads its shard, holds its KV heads' part of the pool, and joins the group before returning.
        batch_invariant: the kernels' batch-invariant table (kernels/ops.py)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.dtype)
        if self.device.type == "cpu":
            if tensor_parallel is not None and tensor_parallel.cores:
                # This thread (the compute thread) and the OpenMP team it starts stay on the rank's core group.
                os.sched_setaffinity(0, tensor_parallel.cores)
            # Every core for the matmuls; the event loop thread mostly waits on this one.
            torch.set_num_threads(num_threads or _usable_cores())
            keep_freed_memory()
        self.source = resolve_model_source(model)
        self.ops = get_ops(kernels, self.device, batch_invariant)
        self.block_size = block_size
        config, weights = open_model(self.source)
        self.model_config: ModelConfig = config   # the whole model's, also under tensor parallelism
        self.tp: TensorParallel | None = None
        kv_heads = config.num_kv_heads   # per rank: the pool of every rank holds as many blocks
        if tensor_parallel is not None:
            if max_loras:
                weights.close()
                raise ValueError("LoRA adapters are not served with --tensor-parallel-size above 1")
            try:
                plans = plan_shards(config, tensor_parallel.size)
            except ValueError:
                weights.close()
                raise
            plan = plans[tensor_parallel.rank]
            kv_heads = max(len(p.kv_heads) for p in plans)
            weights = ShardedWeights(weights, plan, config)
            self.tp = TensorParallel(tensor_parallel, plans, self.device)
            self.model = DecoderModel(plan.local_config(config), self.ops, self.dtype, self.device, self.tp)
        else:
            self.model = DecoderModel(config, self.ops, self.dtype, self.device)
        why = why_dequantized(quantization, self.device, self.ops) if self.source.kind == "gguf" else None
        if why:
            structlog.get_logger().info("GGUF weights dequantized at load", reason=why,
                                        dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        try:
            self.model.load_weights(weights, label=f"loading {os.path.basename(self.source.path)}",
                                    quantization=quantization)
            file_bytes = weights.tensor_bytes() if self.source.kind == "gguf" else None
            # A GGUF type no kernel reads (Q2_K, Q3_K, IQ3_S, ...) is dequantized even where the rest stays packed.
            unread = weights.dequantized_types() if self.source.kind == "gguf" and not why else {}
        finally:
            weights.close()
        if unread:
            structlog.get_logger().warning("GGUF tensors dequantized at load: no kernel reads their type in its "
                                           "blocks", file_bytes_by_type=unread,
                                           dtype=str(self.dtype).removeprefix("torch."))
        by_format = self.model.weight_bytes()
        self.weight_bytes = sum(by_format.values())   # resident: what `matinee serve` reports in its stats
        structlog.get_logger().info("weights resident", bytes=self.weight_bytes, by_format=by_format,
                                    quantization=quantization, file_tensor_bytes=file_bytes,
                                    of_file=None if not file_bytes else round(self.weight_bytes / file_bytes, 3))

        # As `matinee plan` has it, plus an int8 or fp8 cache's scales.
        self.kv_bytes_per_block = kv_bytes_per_block(config.num_layers, kv_heads, config.head_dim,
                                                     self.kv_cache_dtype.itemsize, block_size,
                                                     scaled=self.kv_cache_dtype in QUANTIZED_DTYPES)
        self.kv_bytes_per_token = self.kv_bytes_per_block / block_size
        if num_blocks is None:
            budget = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else int(kv_cache_memory)
            num_blocks = budget // self.kv_bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={budget} bytes holds no block "
                                 f"(one block takes {self.kv_bytes_per_block} bytes)")
        elif num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.kv_caches = self.allocate_kv_caches(config.num_layers, self.num_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_batch and self.device.type == "cuda" and self.ops.backend == "triton" and self.tp is None \
                and not is_quantized(self.kv_caches[0][0]):
            t0 = time.perf_counter()
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, cuda_graph_batch,
                                              min(self.max_model_len, self.num_blocks * block_size), block_size)
            structlog.get_logger().info("decode steps captured as CUDA graphs", batch_sizes=self.decode_graphs.sizes,
                                        seconds=round(time.perf_counter() - t0, 1))
        self._tokenizer = None
        self.last_prepare_s = 0.0     # flattening the batch (host work)
        self.last_forward_s = 0.0     # the model forward alone, for the engine's overhead measure
        self._cursor: DecodeCursor | None = None   # the last step, when it was decodes alone: execute_next
        self._cursor_adapters: list = []            # its sequences' LoRA adapters, and their LoRABatch
        self._cursor_lora: LoRABatch | None = None
        # Called with each layer's index once the forward wrote its KV (model.forward's layer_written),
        # while the worker runs a step whose prompts go layer by layer to a decode engine.
        self.layer_written: Callable[[int], None] | None = None
        self._pinned = PinnedBatch(self.device)
        # On the CPU torch's adapters' small matmuls run in float32 whatever the model dtype: its bfloat16 ones
        # of a few rows took 2-3x as long (Zen 4, rank 16, 2-row segments: 40 against 15 us). The C kernel
        # (lora_sgmv.c) widens bfloat16 weights in registers: in the model dtype, half the bytes a step reads.
        lora_dtype = self.dtype if self.device.type != "cpu" or self.ops.add_lora is lora_cpu.add_lora \
            else torch.float32
        self.loras = LoRASlots(config, max_loras, max_lora_rank, lora_dtype, self.device,
                               self.ops.add_lora) if max_loras else None
        self.max_lora_rank = max_lora_rank
        self.pooling = read_pooling(self.source.path if self.source.kind == "hf" else None)
        self.last_pooled: torch.Tensor | None = None   # the last forward's pooled rows (FlatBatch.pool_indices)

    def allocate_kv_caches(self, num_layers: int, num_blocks: int) -> list[LayerKV]:
        """Paged K and V caches, one contiguous [num_blocks, block_size, Hk, D] pair per layer (with
        their scales [num_blocks, Hk] for an int8 or fp8 cache).

        Also for a layer-skip draft: its own caches for its first `num_layers` layers, passed to forward().
        """
        cfg = self.model.config   # a tensor-parallel rank's: its KV heads alone
        # One allocation. Zeroed, not empty: attention masks unused slots, but 0 * NaN garbage is still NaN.
        kv = torch.zeros(num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                         dtype=self.kv_cache_dtype, device=self.device)
        if not is_quantized(kv):
            return [LayerKV(kv[i, 0], kv[i, 1]) for i in range(num_layers)]
        scales = torch.zeros(num_layers, 2, num_blocks, cfg.num_kv_heads, dtype=torch.float32, device=self.device)
        return [LayerKV(kv[i, 0], kv[i, 1], scales[i, 0], scales[i, 1]) for i in range(num_layers)]

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    @property
    def tokenizer(self):
        """The model's Tokenizer (actors.text.tokenizer): the engine hands over the one it loaded; loaded
        here on first use only when nobody did (the forward never needs it)."""
        if self._tokenizer is None:
            from actors.text.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def execute(self, batch: ForwardBatch, kv_caches: list[LayerKV] | None = None) -> torch.Tensor:
        """Runs one step; returns float32 logits [batch.num_logits, vocab], sequences in batch order.

        `kv_caches` (default: the runner's own) may hold fewer layers: see allocate_kv_caches.
        """
        t0 = time.perf_counter()
        self._cursor = None
        caches = self.kv_caches if kv_caches is None else kv_caches
        flat = flatten(batch, self.block_size, caches[0][0].shape[0], self.model_config.vocab_size)
        lora = self._lora_batch(batch)
        logits = self._timed_forward(flat, caches, t0, lora)
        if kv_caches is None and DecodeCursor.fits(flat):
            self._cursor = DecodeCursor(flat, [s.block_table for s in batch.seqs], self.block_size,
                                        self.model_config.vocab_size)
            self._cursor_adapters, self._cursor_lora = [s.adapter for s in batch.seqs], lora
        return logits

    def _lora_batch(self, batch: ForwardBatch) -> LoRABatch | None:
        adapters = [s.adapter for s in batch.seqs]
        if self.loras is None:
            if any(adapters):
                raise ValueError("a LoRA adapter asked of a runner without adapter slots (max_loras 0)")
            return None
        return self.loras.batch(adapters, [len(s.token_ids) for s in batch.seqs])

    def execute_next(self, token_ids: list[int]) -> torch.Tensor:
        """The decode step after the one `execute` (or this) ran last, when that one was decodes alone:
        the same sequences, each one position further and fed its token from `token_ids` (batch order).
        For a decode burst; the same logits as `execute` on that batch, without flattening it anew."""
        t0 = time.perf_counter()
        cursor, self._cursor = self._cursor, None
        if cursor is None:
            raise RuntimeError("execute_next follows a step of decodes alone")
        if not cursor.advance(token_ids):
            return self.execute(cursor.batch(token_ids, self._cursor_adapters))
        logits = self._timed_forward(cursor.flat, self.kv_caches, t0, self._cursor_lora)
        self._cursor = cursor
        return logits

    def _timed_forward(self, flat: FlatBatch, caches: list[LayerKV], t0: float,
                       lora: LoRABatch | None = None) -> torch.Tensor:
        if flat.max_seq_len > self.max_model_len:
            raise ValueError(f"sequence of {flat.max_seq_len} tokens exceeds the model's "
                             f"context length {self.max_model_len}")
        t1 = time.perf_counter()
        logits = self.forward(flat, caches, lora)
        self.last_prepare_s, self.last_forward_s = t1 - t0, time.perf_counter() - t1
        return logits

    def forward(self, flat: FlatBatch, kv_caches: list[LayerKV], lora: LoRABatch | None = None) -> torch.Tensor:
        """The step's logits; the hidden states its embeddings pool go to `last_pooled`. `lora`: each
        row's LoRA adapter (LoRASlots.batch)."""
        self.last_pooled = None
        if flat.input_ids.shape[0] == 0:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32)
        pool = flat.pool_indices if flat.pool_indices.shape[0] else None
        if pool is None and lora is None and self.decode_graphs is not None \
                and self.decode_graphs.fits(flat, kv_caches):
            return self.decode_graphs.run(flat)
        if self.tp is None:
            return self._forward(flat, kv_caches, pool, lora)
        if kv_caches is not self.kv_caches:
            raise ValueError("a tensor-parallel model runs on its own KV caches only (no layer-skip draft)")
        self.tp.send_plan(flat)
        try:
            return self._forward(flat, kv_caches, pool, lora)
        except Exception as e:   # the other ranks ran on or failed: the ranks are out of step for good
            self.tp.broken = self.tp.broken or f"rank 0 failed a step after sending its plan: {e!r}"
            raise

    def _forward(self, flat: FlatBatch, kv_caches: list[LayerKV], pool: torch.Tensor | None,
                 lora: LoRABatch | None) -> torch.Tensor:
        input_ids, positions, slots, tables, seq_lens, starts, logits_indices = self._on_device(flat)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=starts,
                                 max_query_len=flat.max_query_len, max_seq_len=flat.max_seq_len)
        with torch.inference_mode():
            out = self.model.forward(input_ids, positions, meta, kv_caches, logits_indices,
                                     layer_written=self.layer_written,
                                     pool_indices=None if pool is None else pool.to(self.device), lora=lora)
            if pool is not None:
                out, self.last_pooled = out[0], out[1].float().cpu()
            return out.float()

    def follow(self) -> None:
        """A tensor-parallel rank past 0: runs every step rank 0 plans, until it stops the group."""
        while (flat := self.tp.receive_plan()) is not None:
            pool = flat.pool_indices if flat.pool_indices.shape[0] else None
            self._forward(flat, self.kv_caches, pool, None)

    def collective_seconds(self) -> tuple[float, float]:
        """This rank's cumulative seconds inside the all-reduces, and inside every collective (TensorParallel's
        timers); zeros without tensor parallelism."""
        return (0.0, 0.0) if self.tp is None else (self.tp.all_reduce_s, self.tp.collective_s)

    def close(self) -> None:
        """Under tensor parallelism, rank 0 stops the other ranks and every rank leaves the group."""
        if self.tp is None:
            return
        try:
            if self.tp.rank == 0 and self.tp.broken is None:
                self.tp.send_stop()
        finally:
            self.tp.close()

    def _on_device(self, flat: FlatBatch) -> list[torch.Tensor]:
        """The batch's arrays where the forward runs: on a GPU, in one copy from pinned memory."""
        parts = [flat.input_ids, flat.positions, flat.slot_mapping, flat.block_tables, flat.seq_lens,
                 flat.query_start_loc, flat.logits_indices]
        if self.device.type == "cpu":
            return parts
        input_ids, positions, slots, tables, seq_lens, starts, logits_indices = self._pinned.send(parts)
        return [input_ids, positions, slots, tables.int(), seq_lens.int(), starts.int(), logits_indices]


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
