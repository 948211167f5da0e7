"""Message registration rules and structured logging output."""
import json

import msgspec
import pytest
import structlog

from runtime import Actor, configure_logging, get_logger, register_messages
from runtime.log import bound
from runtime.protocol import is_registered


class Tagged(msgspec.Struct, tag=True):
    x: int


class Untagged(msgspec.Struct):
    x: int


def test_register_messages_accepts_tagged_structs_only():
    register_messages(Tagged)
    register_messages(Tagged)   # idempotent
    assert is_registered(Tagged)
    with pytest.raises(ValueError):
        register_messages(Untagged)
    with pytest.raises(TypeError):
        register_messages(dict)


def test_json_logs_carry_bound_context(capsys):
    configure_logging("DEBUG", json=True)
    try:
        log = get_logger(node="n1").bind(actor="a")
        with bound(request_id="req-7"):
            log.info("hello", k=1)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        rec = json.loads(line)
        assert rec["event"] == "hello" and rec["node"] == "n1" and rec["actor"] == "a"
        assert rec["request_id"] == "req-7" and rec["level"] == "info"
    finally:
        configure_logging("INFO", json=True)
    with pytest.raises(ValueError):
        configure_logging("LOUD")


async def test_actor_logger_binds_node_and_actor(system, capsys):
    configure_logging("INFO", json=True)
    seen = {}

    class Talker(Actor):
        async def receive(self, msg):
            self.context.log.info("working")
            return True

    system.log = get_logger(node=system.name)
    ref = await system.spawn(Talker(), name="talker")
    await ref.ask("go")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    seen = [r for r in lines if r["event"] == "working"][0]
    assert seen["node"] == "test" and seen["actor"] == "talker"
    assert structlog.is_configured()


def test_run_uses_uvloop_when_installed():
    import runtime
    from runtime.loop import using_uvloop

    async def probe():
        return using_uvloop()

    assert runtime.run(probe()) is True
