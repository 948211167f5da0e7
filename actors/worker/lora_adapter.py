"""A LoRA adapter read from a PEFT folder (adapter_config.json + adapter_model.safetensors), checked
against the base model's shapes.

Each target projection's A [r, in] and B [out, r] are kept on the CPU as the file stores them, with the
scale lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)); the slot pool (lora_slots.py) lays them out, scaled,
on the device when a request needs them. Reading does no tensor arithmetic, so it may run on any thread
(a parallel torch op off the compute thread slows every later forward: worker_actor.compute_thread).
Anything the engine cannot serve is a LoRAError naming the problem.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from actors.model.config import ModelConfig

# PEFT's module names for the projections the engine adapts, and where each lives in a layer.
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
MODULE_PATHS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_ids = itertools.count(1)


class LoRAError(ValueError):
    """An adapter folder the engine refuses; the message names the problem (a 400 at the gateway)."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every adaptable projection of the base model."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


@dataclass(eq=False)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float
    modules: frozenset[str]                  # which of MODULES it adapts
    # (layer, module) -> (A [r, in], B [out, r]), as stored, on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    uid: int = field(default_factory=lambda: next(_ids))   # a reload of the same name is another adapter
    digest: str = ""                         # of what it computes (content_digest): its KV's identity

    @property
    def key(self) -> str:
        """The adapter's identity in the prefix cache's hashes: its name and its contents, so that KV computed
        with other weights under the same name (reloaded, or changed on disk across a restart) never matches."""
        return f"{self.name}@{self.digest}"


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in folder `path`, checked against the base model `cfg` and `max_rank`."""
    config = _read_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"adapter {name!r}: `r` in {CONFIG_FILE} must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("modules_to_save", (None, [])),
                         ("rank_pattern", (None, {})), ("alpha_pattern", (None, {}))):
        if config.get(key) not in allowed:
            raise LoRAError(f"adapter {name!r}: {key}={config.get(key)!r} is not supported")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"adapter {name!r}: `lora_alpha` in {CONFIG_FILE} must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(name, path, cfg, rank)
    modules = frozenset(m for _, m in weights)
    if not modules:
        raise LoRAError(f"adapter {name!r} adapts none of the projections "
                        f"{', '.join(m + '_proj' for m in MODULES)} (target_modules "
                        f"{config.get('target_modules')!r})")
    return LoRAAdapter(name, os.path.abspath(path), rank, scale, modules, weights,
                       digest=content_digest(scale, weights))


def content_digest(scale: float, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    """SHA-256 (its first 16 hex digits) of the scale and every A and B, their places, dtypes and shapes: two
    adapters with one digest compute the same KV."""
    h = hashlib.sha256(repr(float(scale)).encode())
    for (layer, module), pair in sorted(weights.items()):
        for t in pair:
            h.update(f"{layer}.{module}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAError(f"adapter folder {path!r} does not exist")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"adapter folder {path!r} has no {CONFIG_FILE}")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {path!r} is a {config.get('peft_type')} adapter, not LORA")
    return config


_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
                  r"\.lora_([AB])(?:\.[^.]+)?\.weight$")


def _read_weights(name: str, path: str, cfg: ModelConfig, rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"adapter folder {path!r} has no {WEIGHTS_FILE}")
    module_of = {p: m for m, p in MODULE_PATHS.items()}
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    if "lora_" in key or "embed" in key or "lm_head" in key:
                        raise LoRAError(f"adapter {name!r}: tensor {key!r} adapts a module the engine cannot "
                                        f"(only {', '.join(m + '_proj' for m in MODULES)})")
                    continue
                layer, module = int(m.group(1)), module_of[m.group(2)]
                if layer >= cfg.num_layers:
                    raise LoRAError(f"adapter {name!r}: tensor {key!r} is for layer {layer}, the base model "
                                    f"has {cfg.num_layers}")
                halves.setdefault((layer, module), {})[m.group(3)] = f.get_tensor(key)
    except SafetensorError as e:
        raise LoRAError(f"{file} is not a readable safetensors file: {e}") from None
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module}_proj has lora_{''.join(ab)} "
                            f"without its other half")
        a, b = ab["A"], ab["B"]
        d_in, d_out = shapes[module]
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise LoRAError(f"adapter {name!r}: layer {layer} {module}_proj has lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)}; rank {rank} on the base model needs "
                            f"{(rank, d_in)} and {(d_out, rank)} (wrong base model?)")
        weights[(layer, module)] = (a, b)
    return weights
