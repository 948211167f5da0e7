"""The gateway's settings: one dataclass built from CLI flags, validated with clear ValueErrors."""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("all", "gateway", "engine", "draft")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None   # None: derived from the model path
    max_waiting: int = 256                 # submitted requests without a first token; more get 429
    max_body_bytes: int = 4 << 20
    ping_interval_s: float = 15.0          # `: ping` on a stream idle this long
    read_timeout_s: float = 30.0           # a request's headers, and then its body, must arrive within this
    retry_after_s: int = 1
    role: str = "all"

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
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
