"""The gateway's settings, and what every `matinee serve` process is: dataclasses built from CLI
flags (a field with `metadata={"help": ...}` is one, see gateway/flags.py), validated with ValueErrors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

ROLES = ("all", "gateway", "engine", "draft", "prefill", "decode")


@dataclass
class ProcessConfig:
    role: str = field(default="all", metadata={
        "help": "which part of the system this process runs: all (embedded), gateway, engine or draft; "
                "prefill and decode are engines that hand a prompt's KV over (disaggregation)",
        "choices": ROLES})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})


@dataclass
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "where the HTTP API listens"})
    port: int = field(default=8000, metadata={"help": "the HTTP API's port"})
    api_key: list[str] | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY`; repeat it, or give several, for several keys "
                "(default: $MATINEE_API_KEY, else none)", "secret": True, "nargs": "+", "metavar": "KEY"})
    served_model_name: list[str] | None = field(default=None, metadata={
        "help": "the `model` names clients may use, the first one reported (unset: derived from the "
                "model path)", "nargs": "+", "metavar": "NAME"})
    max_waiting: int = field(default=256, metadata={
        "help": "requests waiting for their first token before new ones get 429"})
    max_body_bytes: int = field(default=4 << 20, metadata={
        "help": "the largest request body (e.g. 4MiB)", "type": "bytes"})
    ping_interval_s: float = field(default=15.0, metadata={
        "help": "seconds of silence before a stream gets a `: ping` comment", "flag": "ping-interval"})
    read_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds a client has to send a request's headers, and then its body",
        "flag": "read-timeout"})
    api_key_file: str | None = field(default=None, metadata={
        "help": "a file of API keys, one a line (blank lines and lines starting with # are skipped), "
                "accepted besides --api-key"})
    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "origins a browser page may call the API from (CORS), as vLLM: * for any", "nargs": "+",
        "metavar": "ORIGIN"})
    disable_access_log: bool = field(default=False, metadata={
        "help": "no log line per HTTP request (method, path, status, duration, request id)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, or a file holding one, instead of the model's own"})
    tool_call_parser: str = field(default="hermes", metadata={
        "help": "the model's tool-call format, parsed into tool_calls (vLLM's names)",
        "choices": ("hermes", "llama3_json")})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "a reasoning model's format: its thinking goes to reasoning_content, its answer to "
                "content (vLLM's names)", "choices": ("qwen3", "deepseek_r1")})
    max_tokens_default: int | None = field(default=None, metadata={
        "help": "the max_tokens of a request that sends none, within what the context leaves and "
                "--max-tokens-limit (unset: as vLLM, the rest of the context for chat, 16 for completions)"})
    max_tokens_limit: int | None = field(default=None, metadata={
        "help": "the most max_tokens (or max_completion_tokens) a request may ask for: more is a 400 "
                "naming this limit, and a request that sends none gets at most this (unset: the context)"})
    max_grammar_chars: int = field(default=65536, metadata={
        "help": "the longest structured output a request may give (JSON schema, regex, grammar, choices, "
                "forced tool calls), in characters; longer is a 400"})
    grammar_timeout_s: float = field(default=5.0, metadata={
        "help": "seconds a structured output may take to compile at the gateway; longer is a 400",
        "flag": "grammar-timeout"})
    response_store_entries: int = field(default=4096, metadata={
        "help": "responses of /v1/responses kept for previous_response_id and GET, least recently used "
                "out first (0: none kept; per gateway process, in memory)"})
    response_store_memory: int = field(default=64 << 20, metadata={
        "help": "the bytes the stored responses may take together (e.g. 64MiB)", "type": "bytes"})
    response_store_ttl_s: float = field(default=3600.0, metadata={
        "help": "seconds a stored response is kept after it was made", "flag": "response-store-ttl"})
    batch_dir: str | None = field(default=None, metadata={
        "help": "where /v1/files and /v1/batches keep files, batches and finished lines, so a batch resumes "
                "after a restart (unset: a temporary directory, gone when the server stops)"})
    batch_max_file_bytes: int = field(default=200 << 20, metadata={
        "help": "the largest file /v1/files takes (e.g. 200MiB); a batch line may be at most --max-body-bytes",
        "type": "bytes"})
    batch_max_lines: int = field(default=50000, metadata={"help": "request lines one batch may hold"})
    batch_concurrency: int = field(default=64, metadata={
        "help": "batch lines (of all batches) in the engine at once; each runs only in room interactive "
                "requests leave"})
    batch_file_ttl_s: float = field(default=30 * 86400.0, metadata={
        "help": "seconds a file (a batch's input, output or errors) is kept after it was made",
        "flag": "batch-file-ttl"})
    batch_retention_s: float = field(default=30 * 86400.0, metadata={
        "help": "seconds an ended batch is kept after it ended: then it goes, with its output and error files",
        "flag": "batch-retention"})
    enable_lora_runtime_updates: bool = field(default=False, metadata={
        "help": "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), behind the API key"})
    retry_after_s: int = 1
    api_keys: tuple[str, ...] = field(default=(), init=False)   # --api-key and --api-key-file's keys

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.ping_interval_s <= 0:
            raise ValueError(f"ping_interval_s must be positive, got {self.ping_interval_s}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be positive, got {self.read_timeout_s}")
        if self.max_grammar_chars < 1:
            raise ValueError(f"max_grammar_chars must be at least 1, got {self.max_grammar_chars}")
        if self.grammar_timeout_s <= 0:
            raise ValueError(f"grammar_timeout_s must be positive, got {self.grammar_timeout_s}")
        for name in ("max_tokens_default", "max_tokens_limit"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if None not in (self.max_tokens_default, self.max_tokens_limit) and \
                self.max_tokens_default > self.max_tokens_limit:
            raise ValueError(f"max_tokens_default ({self.max_tokens_default}) must be at most "
                             f"max_tokens_limit ({self.max_tokens_limit})")
        if self.response_store_entries < 0 or self.response_store_memory < 0:
            raise ValueError("response_store_entries and response_store_memory must not be negative")
        if self.response_store_ttl_s <= 0:
            raise ValueError(f"response_store_ttl_s must be positive, got {self.response_store_ttl_s}")
        if self.batch_max_file_bytes < 1 or self.batch_max_lines < 1 or self.batch_concurrency < 1:
            raise ValueError("batch_max_file_bytes, batch_max_lines and batch_concurrency must be at least 1")
        if self.batch_file_ttl_s <= 0:
            raise ValueError(f"batch_file_ttl_s must be positive, got {self.batch_file_ttl_s}")
        if self.batch_retention_s <= 0:
            raise ValueError(f"batch_retention_s must be positive, got {self.batch_retention_s}")
        if isinstance(self.api_key, str):   # one key, as before several were allowed
            self.api_key = [self.api_key]
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.api_key is not None and not all(self.api_key):
            raise ValueError("api_key must not be empty")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name must not be empty")
        self.api_keys = tuple(self.api_key or ()) + (read_api_keys(self.api_key_file) if self.api_key_file else ())
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)

    @property
    def model_names(self) -> list[str]:
        return list(self.served_model_name or ())


def read_api_keys(path: str) -> tuple[str, ...]:
    """One key a line; a file that holds none is an error (it would leave the server open)."""
    try:
        with open(path, encoding="utf-8") as f:
            keys = tuple(k for line in f if (k := line.strip()) and not k.startswith("#"))
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    if any(any(c.isspace() for c in k) for k in keys):
        raise ValueError(f"the API key file {path} has a line with spaces inside a key")
    return keys


def load_chat_template(value: str) -> str:
    """vLLM's rule: a path to a file, else the template itself when it looks like Jinja. The
    template is parsed here, so a broken one fails at start, not on the first chat request."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
    return template
