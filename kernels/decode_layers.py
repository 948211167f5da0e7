"""A step's decoder layers in one C call (decode_layers.c) on the CPU backend.

model.py's layer loop calls ~10 kernels a layer through the ops table; at one row the Python around
them (checks, views, allocations, ctypes conversions) took as long as the kernels. `run` takes the
same step when the attention kernels take its heads (decodes and verifications through the decode
kernel, prefill chunks beside them through the prefill kernel) and every projection is one the C loop
can call (a GGUF weight through quant_gemm.c, a K-quant mix's type runs side by side, a packed bf16 one
through packed_gemm.c), with a step's LoRA adapters added after each projection (lora_sgmv.c): the same
kernels on the same arguments in the same order, so the same bits. The layers' weight pointers are laid out
once per model, the caches' once per cache list. Anything else returns None, and the model runs its
own loop.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from kernels import cpu_native
from kernels.kv_quant import check_scales, is_quantized
from kernels.lora import block_table, segment_table
from kernels.packed_linear import PackedWeight
from kernels.paged_attention_cpu import INVARIANT_QUERY_LEN, MAX_QUERY_LEN, cache_kind, kernel_takes
from kernels.quant_linear import QuantStack, QuantWeight

GGUF, PACKED, PACKED_DOT, PACKED_HALF = 0, 1, 2, 3   # decode_layers.c's projection kinds
_ptr, _long, _int, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("w", _ptr), ("bias", _ptr), ("N", _long), ("K", _long), ("kind", _int), ("qtype", _int),
                ("amx_from", _long)]


MAX_PARTS = 3   # decode_layers.c's parts of one projection (a QuantStack's type runs)


class _Projection(ctypes.Structure):
    _fields_ = [("part", _Part * MAX_PARTS), ("parts", _int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


class _LayerCache(ctypes.Structure):
    _fields_ = [("k", _ptr), ("v", _ptr), ("k_scales", _ptr), ("v_scales", _ptr)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _long) for name in ("hidden", "Hq", "Hk", "D", "intermediate", "block_size", "num_blocks",
                                           "table_width", "cos_sin_rows", "short_max")] + \
               [("eps", _float), ("scale", _float), ("bf16", _int), ("cache", _int), ("cos_sin", _ptr)]


class _LoRAGroup(ctypes.Structure):
    _fields_ = [("segments", _ptr), ("n_segments", _long), ("blocks", _ptr), ("n_blocks", _long), ("R", _long)]


GROUPS = ("qkv", "o", "gate_up", "down")   # decode_layers.c's order of a layer's projection groups


class _LoRA(ctypes.Structure):
    _fields_ = [("group", _LoRAGroup * len(GROUPS)), ("stacks", _ptr), ("w_bf16", _int)]


LayerWritten = ctypes.CFUNCTYPE(None, _long)   # called back, holding the GIL, with each layer written
_NOBODY = LayerWritten()                         # NULL: no call back


def declare(lib: ctypes.CDLL) -> None:
    lib.matinee_decode_layers.restype = _int
    lib.matinee_decode_layers.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_LayerCache), _long,
                                          ctypes.POINTER(_Shape)] + [_ptr] * 8 + [_long] * 2 + \
                                         [_int, LayerWritten, ctypes.POINTER(_LoRA)]


class _Plan:
    """One model's layers as decode_layers.c reads them; `keep` holds what the pointers point into."""

    def __init__(self, model, rows_limit: int | None) -> None:
        self.layers = (_Layer * len(model.layers))()
        self.keep: list[torch.Tensor] = []
        self.rows_limit = rows_limit   # a packed weight with a plain copy beside it: torch from these rows
        for slot, layer in zip(self.layers, model.layers):
            slot.input_norm, slot.post_norm = self._tensor(layer.input_norm), self._tensor(layer.post_norm)
            slot.q_norm, slot.k_norm = self._tensor(layer.q_norm), self._tensor(layer.k_norm)
            for name, weight, bias in (("qkv", layer.qkv_weight, layer.qkv_bias), ("o", layer.o_weight, layer.o_bias),
                                       ("gate_up", layer.gate_up_weight, None), ("down", layer.down_weight, None)):
                setattr(slot, name, self._projection(weight, bias))
        self.caches: tuple[int, list[int], ctypes.Array] | None = None

    def _tensor(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.keep.append(t)
        return t.data_ptr()

    def _projection(self, weight, bias: torch.Tensor | None) -> _Projection:
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()   # as cpu_native.projection converts it each call
        projection, start = _Projection(parts=len(_parts(weight))), 0
        for slot, part in zip(projection.part, _parts(weight)):
            end = start + part.out_features
            amx_from = 0
            if isinstance(part, QuantWeight):
                kind, qtype, amx_from = GGUF, int(part.qtype), part.amx_from or 0
            else:
                kind = PACKED_HALF if part.half else PACKED_DOT if part.dot else PACKED
                qtype, amx_from = 0, part.amx_from or 0
            slot.w, slot.bias = self._tensor(part.packed), self._tensor(None if bias is None else bias[start:end])
            slot.N, slot.K, slot.kind, slot.qtype, slot.amx_from = (part.out_features, part.in_features, kind, qtype,
                                                                   amx_from)
            start = end
        return projection

    def layer_caches(self, kv_caches: list) -> ctypes.Array:
        key = [p for kv in kv_caches for p in (kv[0].data_ptr(), kv[1].data_ptr())]
        if self.caches is None or self.caches[0] != id(kv_caches) or self.caches[1] != key:
            array = (_LayerCache * len(kv_caches))()
            for slot, kv in zip(array, kv_caches):
                k, v, k_scales, v_scales = (*kv, None, None)[:4]
                slot.k, slot.v = k.data_ptr(), v.data_ptr()
                slot.k_scales = None if k_scales is None else k_scales.data_ptr()
                slot.v_scales = None if v_scales is None else v_scales.data_ptr()
            self.caches = (id(kv_caches), key, array)
        return self.caches[2]


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> _Plan, or None where it cannot


def _parts(weight) -> list:
    return weight.parts if isinstance(weight, QuantStack) else [weight]


def _supported(model) -> bool:
    cfg = model.config
    if model.dtype not in (torch.float32, torch.bfloat16) or model.device.type != "cpu" or cfg.head_dim % 2:
        return False
    for layer in model.layers:
        for weight in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
            parts = _parts(weight)
            # a packed weight is bf16 (or float16) under either activation dtype (packed_gemm.c takes both rows)
            if len(parts) > MAX_PARTS or any(not isinstance(p, (QuantWeight, PackedWeight))
                                             or (isinstance(p, QuantWeight) and p.dtype != model.dtype) for p in parts):
                return False
        norms = [layer.input_norm, layer.post_norm] + [n for n in (layer.q_norm, layer.k_norm) if n is not None]
        if any(n.dtype != model.dtype or not n.is_contiguous() for n in norms):
            return False
    cos_sin = model.cos_sin_cache
    return cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == cfg.head_dim


def _plan(model) -> _Plan | None:
    if model not in _plans:
        torch_from = [w.torch_from for layer in model.layers
                      for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
                      if isinstance(w, PackedWeight) and w.plain is not None]
        _plans[model] = _Plan(model, min(torch_from, default=None)) if _supported(model) else None
    return _plans[model]


_lora_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # LoRASlots -> its stacks' pointers


def _lora(lora, ops, dtype: torch.dtype, num_tokens: int) -> _LoRA | None:
    """A step's adapters as decode_layers.c reads them, or None where the pool adds them otherwise than through
    the CPU table's add_lora (lora_sgmv.c), or that would not take them: the layer loop then adds them."""
    slots = lora.slots
    if slots.add is not ops.add_lora or slots.a["qkv"][0].dtype not in (torch.float32, torch.bfloat16) \
            or dtype not in (torch.float32, torch.bfloat16):
        return None
    if slots not in _lora_stacks:   # the pool's stacks never move: their pointers are laid out once
        pointers = [t.data_ptr() for layer in range(len(slots.a["qkv"])) for g in GROUPS
                    for t in (slots.a[g][layer], slots.b[g][layer])]
        _lora_stacks[slots] = (_ptr * len(pointers))(*pointers)
    arg = _LoRA(stacks=ctypes.cast(_lora_stacks[slots], _ptr), w_bf16=int(slots.a["qkv"][0].dtype == torch.bfloat16))
    keep = []
    for place, g in zip(arg.group, GROUPS):
        segments, a, b = lora.by_group[g], slots.a[g][0], slots.b[g][0]
        if not segments:
            continue
        table = segment_table(segments, slots.layouts[g], a.shape[2], num_tokens, a.shape[0])
        blocks = block_table(slots.layouts[g], a.shape[2], b.shape[2])
        keep += [table, blocks]
        place.segments, place.n_segments, place.blocks, place.n_blocks, place.R = (
            table.data_ptr(), table.shape[0], blocks.data_ptr(), blocks.shape[0], a.shape[2])
    arg.keep = keep   # the tables the pointers point into, alive as long as the argument
    return arg


def run(model, hidden: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list,
        layer_written: Callable[[int], None] | None = None, lora=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layers of `kv_caches` (the first len(kv_caches) of the model) over hidden [T, H], the
    embeddings: (the last layer's output, its residual), or None where the step is not one for
    decode_layers.c. `layer_written(i)` is called (on this thread) once layer i's KV is in its cache.
    `lora` (a LoRABatch) adds the rows' adapters after each projection, as the layer loop does."""
    lib = cpu_native.library()
    num_tokens = hidden.shape[0]
    cfg = model.config
    invariant = model.ops.batch_invariant   # every query run through the decode kernel, which takes any
    if lib is None or num_tokens == 0 or not (invariant or kernel_takes(model.dtype, meta.max_query_len,
                                                                        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)):
        return None
    plan = _plan(model)
    if plan is None or (plan.rows_limit is not None and num_tokens >= plan.rows_limit):
        return None
    adapters = None if lora is None else _lora(lora, model.ops, model.dtype, num_tokens)
    if lora is not None and adapters is None:
        return None
    k_cache, v_cache, k_scales, v_scales = (*kv_caches[0], None, None)[:4]
    quantized = is_quantized(k_cache)
    if not quantized and k_cache.dtype != model.dtype:
        return None
    check_scales(k_cache, v_cache, k_scales, v_scales)
    short_max = INVARIANT_QUERY_LEN if invariant else MAX_QUERY_LEN[model.dtype]
    shape = _Shape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   k_cache.shape[1], k_cache.shape[0], meta.block_tables.shape[1], model.cos_sin_cache.shape[0],
                   short_max, cfg.rms_norm_eps, model.scale, int(model.dtype == torch.bfloat16),
                   cache_kind(k_cache), model.cos_sin_cache.data_ptr())
    embeddings = hidden.contiguous()
    hidden, residual = torch.empty_like(embeddings), torch.empty_like(embeddings)
    positions = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    tables = meta.block_tables.to(torch.int32).contiguous()
    starts = meta.query_start_loc.to(torch.int32).contiguous()
    lens = meta.seq_lens.to(torch.int32).contiguous()
    if slots.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError("decode layers: slot_mapping and positions must have one entry per token")
    status = lib.matinee_decode_layers(plan.layers, plan.layer_caches(kv_caches), len(kv_caches), ctypes.byref(shape),
                                       embeddings.data_ptr(), hidden.data_ptr(), residual.data_ptr(),
                                       positions.data_ptr(), slots.data_ptr(),
                                       tables.data_ptr(), starts.data_ptr(), lens.data_ptr(), lens.shape[0],
                                       num_tokens, torch.get_num_threads(),
                                       LayerWritten(layer_written) if layer_written is not None else _NOBODY,
                                       None if adapters is None else ctypes.byref(adapters))
    if status:
        error, message = _ERRORS.get(status, (MemoryError, "decode layers: no memory for a step's scratch"))
        raise error(message)
    return hidden, residual


_ERRORS = {   # the messages of the kernels' own launchers, for the same failures
    -2: (ValueError, "paged_attention: block tables, query_start_loc and seq_lens disagree"),
    -3: (ValueError, "paged_attention: a block id out of range"),
    -4: (IndexError, "rotary_embedding: a position outside the rotary table"),
    -5: (IndexError, "write_kv: a slot outside the KV cache"),
    -6: (MemoryError, "decode layers: a projection's kernel had no memory for its copy of x"),
    -7: (ValueError, "paged_attention: the CPU kernels do not take these heads"),
}
