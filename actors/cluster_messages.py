"""Messages between a gateway and an engine node of a cluster, beside the engine protocol.

A gateway asks a discovered engine what it serves (`GetEngineInfo`); a draining engine hands a
request it will not admit back to its sender (`SubmitRefused`), which routes it elsewhere.
"""

from __future__ import annotations

import msgspec

from runtime import register_messages


class GetEngineInfo(msgspec.Struct, tag=True):
    pass


class EngineInfo(msgspec.Struct, tag=True):
    engine_id: str                    # the id its prefix-index entries carry
    max_model_len: int
    block_size: int
    model: str                        # the model path as the engine was started with
    draining: bool = False


class SubmitRefused(msgspec.Struct, tag=True):
    request_id: str
    reason: str


register_messages(GetEngineInfo, EngineInfo, SubmitRefused)
