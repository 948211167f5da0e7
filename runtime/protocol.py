"""The set of message types that may cross a process boundary, and its version counter.

Register every application message once (at import of its module) before nodes connect."""
from __future__ import annotations

import msgspec

_registered: dict[type, None] = {}
version = 0


def register_messages(*types: type) -> None:
    """Allow these msgspec Struct types (tag=True) on the wire; idempotent."""
    global version
    changed = False
    for tp in types:
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            raise TypeError(f"{tp!r} is not a msgspec Struct type")
        if tp.__struct_config__.tag is None:
            raise ValueError(f"{tp.__name__} must be declared with tag=True to cross processes")
        if tp not in _registered:
            tag = tp.__struct_config__.tag
            for other in _registered:
                if other.__struct_config__.tag == tag:
                    raise ValueError(f"{tp.__module__}.{tp.__qualname__} and {other.__module__}."
                                     f"{other.__qualname__} share the wire tag {tag!r}")
            _registered[tp] = None
            changed = True
    if changed:
        version += 1


def registered() -> tuple[type, ...]:
    return tuple(_registered)


def is_registered(tp: type) -> bool:
    return tp in _registered
