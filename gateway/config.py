"""The gateway's settings, and what every `matinee serve` process is: dataclasses built from CLI
flags (a field with `metadata={"help": ...}` is one, see gateway/flags.py), validated with ValueErrors.
"""
from __future__ import annotations

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
    api_key: str | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY` (default: $MATINEE_API_KEY, else none)", "secret": True})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the `model` name clients use (unset: derived from the model path)"})
    max_waiting: int = field(default=256, metadata={
        "help": "requests waiting for their first token before new ones get 429"})
    max_body_bytes: int = field(default=4 << 20, metadata={
        "help": "the largest request body (e.g. 4MiB)", "type": "bytes"})
    ping_interval_s: float = field(default=15.0, metadata={
        "help": "seconds of silence before a stream gets a `: ping` comment", "flag": "ping-interval"})
    read_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds a client has to send a request's headers, and then its body",
        "flag": "read-timeout"})
    retry_after_s: int = 1

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
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
