"""The decoder-only transformer (Llama, Qwen2, Qwen3) over a paged KV cache.

One class, parameterised by ModelConfig: Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorm.
Every op comes from `kernels.get_ops`; q/k/v and gate/up are fused into one matmul
each, because fewer, bigger matmuls run faster. It never imports transformers.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from actors.worker.lora_slots import LoRABatch
from actors.model.config import ModelConfig, ModelLoadError
from actors.worker.progress import load_progress
from actors.worker.tensor_parallel import TensorParallel
from kernels import Ops, build_cos_sin_cache
from kernels.packed_linear import PackedWeight
from kernels.quant_linear import QuantStack, QuantTensor, QuantWeight, stack
from kernels.quant_linear_cpu import Int4CpuWeight
from kernels.quantize import Int4Weight, Int8Weight, int4_group_size_for, quantize_int4, quantize_int8

# A matmul weight as ops.prepare_weight / prepare_quantized / prepare_int left it.
Weight = torch.Tensor | PackedWeight | QuantWeight | QuantStack | Int8Weight | Int4Weight | Int4CpuWeight
# auto: GGUF types the kernels read stay packed, a GPTQ or AWQ checkpoint's int4 too; none: all dequantized;
# int8 / int4: a float checkpoint's projections quantized at load.
QUANTIZATIONS = ("auto", "none", "int8", "int4")


def why_dequantized(quantization: str, device: torch.device, ops) -> str | None:
    """None where a GGUF file's quantized blocks stay packed in memory; else why they are dequantized
    at load (to the model dtype, or then requantized under int8 / int4)."""
    if quantization != "auto":
        return f"--quantization {quantization} asks for it"
    if device.type != "cpu":
        return (f"only the CPU's C kernels multiply GGUF blocks; on {device.type} the weights are held in "
                f"the model dtype (--quantization int8 or int4 requantizes them for the GPU kernels)")
    if ops.prepare_quantized is None:
        return f"the {ops.backend} kernels do not multiply GGUF blocks; the CPU's C kernels (--kernels cpu) do"
    return None


@dataclass
class AttentionMetadata:
    """The flattened batch layout that every layer's attention reads (see the kernels contract)."""
    slot_mapping: torch.Tensor        # [T] int64
    block_tables: torch.Tensor        # [B, max_blocks] int32
    seq_lens: torch.Tensor            # [B] int32
    query_start_loc: torch.Tensor     # [B+1] int32
    max_query_len: int
    max_seq_len: int


class LayerKV(NamedTuple):
    """One layer's paged cache: K and V [num_blocks, block_size, Hk, D]; for an int8 or fp8 cache,
    their float32 scales [num_blocks, Hk] (kernels/kv_quant.py)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: Weight
    down_weight: Weight


class DecoderModel:
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        """`config` is the model this instance computes: under tensor parallelism (`tp`) one rank's shard of it
        (ShardPlan.local_config), whose projections' partial sums and vocabulary slices `tp` combines."""
        self.config = config
        self.tp = tp
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = config.head_dim ** -0.5
        self.layers: list[_Layer] = []
        self.embed: Weight | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Weight | None = None
        self.cos_sin_cache = _cos_sin_cache(config).to(self.device)

    def load_weights(self, weights, label: str = "loading weights", quantization: str = "none") -> None:
        """`weights` has get(hf_name, dtype) -> tensor and quantized(hf_name) -> QuantTensor | None (a GPTQ or
        AWQ checkpoint also is_quantized(prefix) and linear(prefix) -> Int4Weight); raises ModelLoadError for a
        missing tensor. quantization "auto" keeps every matmul weight whose stored type the ops read
        quantized (GGUF blocks, GPTQ or AWQ int4, never a float copy); "none" dequantizes all; "int8" / "int4"
        quantize every projection at load (per output channel / in groups), the LM head (and a tied
        embedding, read out of it) to int8 under both, as llama.cpp's 4-bit mixes keep their output."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        cfg = self.config
        int4 = hasattr(weights, "linear")   # a GPTQ or AWQ checkpoint
        if int4 and quantization != "auto":
            raise ModelLoadError(f"a {weights.method} checkpoint is served in its own int4 weights: use quantization "
                                 f"'auto', not {quantization!r}")
        progress = load_progress(cfg.num_layers + 1, label)
        quantize = why_dequantized(quantization, self.device, self.ops) is None
        prepare = self.ops.prepare_weight   # matmul weights in the layout the ops' linear reads fastest

        def at_load(names: tuple[str, ...], head: bool) -> Int8Weight | Int4Weight | None:
            """The projection quantized at load (or read quantized from a GPTQ or AWQ checkpoint), None to keep
            floats."""
            prefixes = [n.removesuffix(".weight") for n in names]
            if int4 and all(weights.is_quantized(p) for p in prefixes):
                return _cat_int4([weights.linear(p) for p in prefixes])
            if quantization not in ("int8", "int4"):
                return None
            w = torch.cat([weights.get(n, torch.float32) for n in names])
            if head or quantization == "int8":
                return quantize_int8(w)
            return quantize_int4(w, int4_group_size_for(w.shape[1]))

        def get(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            return _aligned(weights.get(name, dtype or self.dtype).to(self.device))

        def float_weight(name: str) -> torch.Tensor:
            """A matmul weight's (or the embedding's) floats: a bf16 or float16 checkpoint's stay in their 16 bits
            under float32 activations where the ops multiply float32 rows by them (half the bytes a decode step
            reads)."""
            if self.dtype == torch.float32 and self.ops.prepare_16bit_for_float32 is not None:
                stored = weights.stored_dtype(name)
                if stored in (torch.bfloat16, torch.float16):
                    return get(name, stored)
            return get(name)

        def quantized(*names: str) -> QuantWeight | QuantStack | None:
            """The rows of `names` stacked, in their stored blocks, where the ops read them so: one packed
            weight where they share a type, else one per type run (a K-quant mix's Q4_K q, k and Q6_K v)."""
            if not quantize:
                return None
            parts = [weights.quantized(n) for n in names]
            if any(p is None for p in parts):
                return None
            runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: (p.qtype, p.cols))]
            return stack([self.ops.prepare_quantized(QuantTensor.cat(run), self.dtype) for run in runs])

        def matmul_weight(*names: str, head: bool = False) -> Weight:
            packed = quantized(*names)
            if packed is not None:
                return packed
            loaded = at_load(names, head)
            if loaded is not None:
                return self.ops.prepare_int(_to_device(loaded, self.device), self.dtype)
            floats = [float_weight(n) for n in names]
            weight = torch.cat(floats) if len(floats) > 1 else floats[0]   # float32 if any part is
            return self.ops.prepare_16bit_for_float32(weight) if weight.dtype != self.dtype else prepare(weight)

        self.final_norm = get("model.norm.weight")
        if cfg.tie_word_embeddings:   # one copy, in the LM head's layout: ops.embedding reads rows of it
            self.embed = self.lm_head = matmul_weight("model.embed_tokens.weight", head=True)
        else:
            self.embed = quantized("model.embed_tokens.weight") or float_weight("model.embed_tokens.weight")
            self.lm_head = matmul_weight("lm_head.weight", head=True)
        progress.update()
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([get(attn + f"{x}_proj.bias") for x in "qkv"])
            self.layers.append(_Layer(
                input_norm=get(p + "input_layernorm.weight"),
                qkv_weight=matmul_weight(*(attn + f"{x}_proj.weight" for x in "qkv")),
                qkv_bias=qkv_bias,
                q_norm=get(attn + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if cfg.qk_norm else None,
                o_weight=matmul_weight(attn + "o_proj.weight"),
                o_bias=get(attn + "o_proj.bias") if cfg.o_proj_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up_weight=matmul_weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down_weight=matmul_weight(p + "mlp.down_proj.weight"),
            ))
            progress.update()
        progress.close()
        self._check_shapes()

    def weight_bytes(self) -> dict[str, int]:
        """Bytes resident per weight format ("float", "bf16-packed", "Q4_1", ...), each tensor counted once
        (a tied embedding is the LM head)."""
        seen, total = set(), {}
        tensors = [self.embed, self.lm_head, self.final_norm] + [v for layer in self.layers for v in vars(layer).values()]
        for t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            for kind, size in _resident(t):
                total[kind] = total.get(kind, 0) + size
        return total

    def _check_shapes(self) -> None:
        cfg = self.config
        expect = {
            "embed_tokens": (_shape(self.embed), (cfg.vocab_size, cfg.hidden_size)),
            "lm_head": (_shape(self.lm_head), (cfg.vocab_size, cfg.hidden_size)),
            "qkv_proj": (_shape(self.layers[0].qkv_weight), (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)),
            "gate_up_proj": (_shape(self.layers[0].gate_up_weight), (2 * cfg.intermediate_size, cfg.hidden_size)),
        }
        for name, (got, want) in expect.items():
            if tuple(got) != want:
                raise ModelLoadError(f"tensor {name} has shape {tuple(got)}, the config implies {want}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV], logits_indices: torch.Tensor,
                layer_written: Callable[[int], None] | None = None,
                pool_indices: torch.Tensor | None = None,
                lora: LoRABatch | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions [T] -> logits [len(logits_indices), vocab] in the model dtype; with
        `pool_indices`, (logits, hidden states after the final norm [len(pool_indices), hidden]).

        Runs the first len(kv_caches) layers, then the final norm and LM head: passing fewer
        caches gives the self-speculative (layer-skip) draft on the same weights. `layer_written(i)`
        is called as soon as layer i's KV is in its cache. `lora` adds each row's adapter to the
        projections (lora_slots.py), in the fused all-layers kernel too.
        """
        cfg, ops = self.config, self.ops
        if not 0 < len(kv_caches) <= cfg.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a model of {cfg.num_layers} layers")
        eps = cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        q_size, kv_size, head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        tp = self.tp
        if tp is None:
            hidden = ops.embedding(input_ids, self.embed).to(self.dtype)   # int8 rows come in float32
        else:
            hidden = tp.embedding(ops, input_ids, self.embed, self.dtype)
        residual = None
        # The fused all-layers kernel has no place for the ranks' all-reduces: a shard runs the loop below.
        fused = (ops.decode_layers(self, hidden, positions, meta, kv_caches, layer_written=layer_written, lora=lora)
                 if ops.decode_layers and tp is None else None)
        adapt = lora.add if lora is not None else _no_adapter
        if fused is not None:   # the loop below in one kernel call, bit for bit
            hidden, residual = fused
        for i, (layer, kv) in enumerate(zip(self.layers if fused is None else [], kv_caches)):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                hidden, residual = ops.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = ops.linear(hidden, layer.qkv_weight, layer.qkv_bias)
            adapt(i, "qkv", hidden, qkv)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, head_dim)
            if layer.q_norm is not None:
                # Per-head norm: each (token, head) row of width head_dim is normalised alone.
                q = ops.rms_norm(q.reshape(-1, head_dim), layer.q_norm, eps).view(num_tokens, -1, head_dim)
                k = ops.rms_norm(k.reshape(-1, head_dim), layer.k_norm, eps).view(num_tokens, -1, head_dim)
            q, k = ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
            k_cache, v_cache, k_scales, v_scales = LayerKV(*kv)   # a plain (K, V) pair too
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
            if layer_written is not None:
                layer_written(i)
            attn = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.max_query_len, meta.max_seq_len, self.scale,
                                       k_scales=k_scales, v_scales=v_scales)
            attn = attn.reshape(num_tokens, q_size)
            hidden = ops.linear(attn, layer.o_weight, layer.o_bias)
            adapt(i, "o", attn, hidden)
            if tp is not None:
                tp.all_reduce(hidden)
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
            gate_up = ops.linear(hidden, layer.gate_up_weight)
            adapt(i, "gate_up", hidden, gate_up)
            act = ops.silu_and_mul(gate_up)
            hidden = ops.linear(act, layer.down_weight)
            adapt(i, "down", act, hidden)
            if tp is not None:
                tp.all_reduce(hidden)
        # Only the rows that need logits go through the final norm and the (large) LM head; the rows
        # an embedding pools go through the norm alone.
        pooled = pool_indices is not None and pool_indices.shape[0] > 0
        rows = torch.cat([pool_indices, logits_indices]) if pooled else logits_indices
        if rows.shape[0] != num_tokens or pooled:
            hidden = hidden.index_select(0, rows)
            residual = residual.index_select(0, rows)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        if pool_indices is None:
            return self._logits(hidden)
        num_pooled = pool_indices.shape[0]
        return self._logits(hidden[num_pooled:]), hidden[:num_pooled]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.lm_head)
        return logits if self.tp is None else self.tp.gather_vocab(logits)


def _no_adapter(layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
    pass


def _resident(weight: Weight) -> list[tuple[str, int]]:
    if isinstance(weight, QuantWeight):
        return [(weight.name, weight.nbytes)]
    if isinstance(weight, QuantStack):
        return [kind for part in weight.parts for kind in _resident(part)]
    if isinstance(weight, (Int8Weight, Int4Weight, Int4CpuWeight)):
        kind = "int8" if isinstance(weight, Int8Weight) else "int4"
        return [(kind, sum(t.numel() * t.element_size() for t in vars(weight).values() if torch.is_tensor(t)))]
    if isinstance(weight, PackedWeight):
        plain = [] if weight.plain is None else _resident(weight.plain)
        kind = "f16-packed" if weight.half else "bf16-packed"
        return [(kind, weight.packed.numel() * weight.packed.element_size())] + plain
    return [("float", weight.numel() * weight.element_size())]


def _shape(weight: Weight) -> tuple[int, int]:
    return tuple(weight.shape) if torch.is_tensor(weight) else (weight.out_features, weight.in_features)


def _cat_int4(parts: list[Int4Weight]) -> Int4Weight:
    """Int4 projections stacked along their outputs (q, k and v fused); they share one group size."""
    if len(parts) == 1:
        return parts[0]
    if len({(p.group_size, p.zero is None) for p in parts}) != 1:
        raise ModelLoadError("projections to fuse are quantized with different group sizes or zero points")
    order = parts[0].order
    if any((p.order is None) != (order is None) or (order is not None and not torch.equal(p.order, order))
           for p in parts):   # GPTQ orders q, k and v alike: they read one input, so its statistics agree
        raise ModelLoadError("projections to fuse read their inputs in different orders (GPTQ activation order)")
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), zero,
                      parts[0].group_size, order)


def _to_device(weight: Int8Weight | Int4Weight, device: torch.device) -> Int8Weight | Int4Weight:
    fields = {name: getattr(weight, name) for name in weight.__dataclass_fields__}
    return type(weight)(**{name: v.to(device) if torch.is_tensor(v) else v for name, v in fields.items()})


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The tensor in torch's own 64-byte aligned memory. A weight read straight from a checkpoint may
    sit at any offset of the file's buffer, and MKL's results (to the last bit) depend on that offset:
    the same model loaded from two files would then give different logits."""
    if t.device.type == "cpu" and t.data_ptr() % 64:
        return t.clone()
    return t


def _cos_sin_cache(config: ModelConfig) -> torch.Tensor:
    if config.rope_freq_factors is None:
        return build_cos_sin_cache(config.head_dim, config.max_position_embeddings,
                                   config.rope_theta, config.rope_scaling)
    # llama.cpp stores Llama-3 scaling as per-frequency divisors instead of config numbers.
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
