"""The memory planner over HTTP, for /dashboard/plan: the presets, and the plan itself computed
by actors/model/memory_plan.py, the arithmetic `matinee plan` prints and the engine sizes its pool with,
so the page can never disagree with either.
"""
from __future__ import annotations

import dataclasses

import msgspec
from aiohttp import web

from actors.config import GPU_STEP_TOKENS
from actors.model.memory_plan import DTYPE_BYTES, GGUF_WEIGHT_BYTES, MemoryPlan, parse_size
from actors.model.shape import PRESETS, ModelShape
from actors.model.config import ModelConfig
from gateway import handlers
from gateway.errors import invalid

_encode = msgspec.json.Encoder().encode
DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")


class PlanRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None                 # a preset's name
    config: dict | None = None               # or a Hugging Face config.json, as pasted
    context_len: int | None = None           # unset: the model's context
    concurrency: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    step_tokens: int = GPU_STEP_TOKENS
    gpu_memory: str = "80GB"
    gpus: int = 1                            # for the reverse: the concurrency that many GPUs hold
    backend: str = "gpu"                     # whose int4 layout (memory_plan.BACKENDS)


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


async def presets(request: web.Request) -> web.Response:
    return _json({"presets": {name: dataclasses.asdict(shape) for name, shape in PRESETS.items()},
                  "dtypes": {d: DTYPE_BYTES[d] for d in DTYPES},
                  "weight_dtypes": {d: DTYPE_BYTES[d] for d in DTYPES} | GGUF_WEIGHT_BYTES,
                  "step_tokens": GPU_STEP_TOKENS})


def plan_of(req: PlanRequest) -> dict:
    """What `matinee plan --json --fit` prints for the same inputs. Raises ValueError."""
    if (req.model is None) == (req.config is None):
        raise ValueError("give exactly one of `model` (a preset) and `config` (a config.json)")
    if req.model is not None:
        if req.model.lower() not in PRESETS:
            raise ValueError(f"unknown preset {req.model!r} ({', '.join(PRESETS)})")
        shape = PRESETS[req.model.lower()]
    else:
        shape = ModelShape.of(ModelConfig.from_hf(req.config), name=str(req.config.get("_name_or_path", "")))
    if req.gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {req.gpus}")
    gpu_memory = parse_size(req.gpu_memory)
    p = MemoryPlan(shape, req.context_len or shape.max_context, req.concurrency, req.weight_dtype,
                   req.kv_dtype, req.step_tokens, backend=req.backend)
    return p.as_dict(gpu_memory) | {"fit_gpus": req.gpus,
                                    "fit_concurrency": p.max_concurrency(req.gpus * gpu_memory)}


async def compute(request: web.Request) -> web.Response:
    try:
        req = msgspec.json.decode(await handlers.read_body(request), type=PlanRequest)
    except msgspec.ValidationError as e:
        raise invalid(f"Invalid plan request: {e}") from None
    except msgspec.DecodeError:
        raise invalid("The body is not valid JSON.") from None
    try:
        return _json(plan_of(req))
    except (ValueError, KeyError, TypeError) as e:   # a pasted config.json may lack a field
        raise invalid(f"Cannot plan this: {e}", param="config" if req.config is not None else "model") from None


ROUTES = [web.get("/dashboard/plan/presets", presets), web.post("/dashboard/plan/compute", compute)]
