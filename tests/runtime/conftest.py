"""Shared fixtures for the runtime tests: a started ActorSystem that is always shut down."""
import pytest

from runtime import ActorSystem


@pytest.fixture
async def system():
    s = ActorSystem("test")
    await s.start()
    yield s
    await s.shutdown()
