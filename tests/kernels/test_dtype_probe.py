"""`--dtype auto` on the CPU: the probe's rule, and the engine config resolving through it."""

import pytest

from actors.config import EngineConfig
from kernels import cpu_native, dtype_probe
from kernels.dtype_probe import DECODE_ROWS as D, PREFILL_ROWS as P


def _ms(bf16_decode: float, bf16_prefill: float) -> dict[str, float]:
    return {f"float32_{D}": 10.0, f"float32_{P}": 100.0, f"bfloat16_{D}": bf16_decode, f"bfloat16_{P}": bf16_prefill}


def _never():
    raise AssertionError("a CPU without bf16 units must not be measured")


def test_a_cpu_without_bf16_units_keeps_float32_unmeasured():
    assert dtype_probe.choose({"avx2", "fma", "avx512f"}, _never).dtype == "float32"


@pytest.mark.parametrize("decode,prefill,expect", [
    (5.0, 100.0, "bfloat16"),     # twice as fast at one row, a tie at 256
    (10.0, 40.0, "bfloat16"),     # AMX: a tie at one row, much faster at 256
    (5.0, 150.0, "float32"),      # faster decodes, but prefill 1.5x slower
    (12.0, 120.0, "float32"),     # slower at both
    (10.5, 102.0, "float32"),     # within noise of float32 at both: not worth the precision
])
def test_bfloat16_only_where_it_measures_faster(decode, prefill, expect):
    choice = dtype_probe.choose({"avx512_bf16"}, lambda: _ms(decode, prefill))
    assert choice.dtype == expect
    assert "avx512_bf16" in choice.reason and "x float32's speed" in choice.reason


@pytest.fixture
def probe(monkeypatch):
    """cpu_dtype with the flags and the measurement replaced; its per-process cache cleared around."""
    def set_result(flags: set[str], ms: dict[str, float]) -> None:
        monkeypatch.setattr(dtype_probe, "cpu_flags", lambda: flags)
        monkeypatch.setattr(dtype_probe, "_cached_measure", lambda: ms)
        monkeypatch.setattr(cpu_native, "available", lambda: True)
        dtype_probe.cpu_dtype.cache_clear()

    yield set_result
    dtype_probe.cpu_dtype.cache_clear()


def test_auto_resolves_to_float32_when_the_probe_finds_bfloat16_slower(probe):
    probe({"avx512_bf16", "amx_bf16"}, _ms(14.0, 300.0))
    assert EngineConfig(dtype="auto", device="cpu").resolved_dtype() == "float32"


def test_auto_resolves_to_bfloat16_when_the_probe_finds_it_faster(probe):
    probe({"avx512_bf16"}, _ms(5.0, 95.0))
    assert EngineConfig(dtype="auto", device="cpu").resolved_dtype() == "bfloat16"
    # The torch backend has no fast bf16 path here: auto stays float32 whatever the probe says.
    assert EngineConfig(dtype="auto", device="cpu", kernels="torch").resolved_dtype() == "float32"


def test_an_explicit_dtype_is_never_probed(probe):
    probe({"avx512_bf16"}, {})
    assert EngineConfig(dtype="float32", device="cpu").resolved_dtype() == "float32"


@pytest.mark.skipif(not cpu_native.available(), reason="no AVX2 CPU or no C compiler")
def test_the_measurement_times_both_dtypes_at_both_sizes(monkeypatch):
    monkeypatch.setattr(cpu_native, "last_level_cache_bytes", lambda: 1 << 20)   # the 4-matrix minimum
    ms = dtype_probe.measure(repeats=1)
    assert set(ms) == {f"{dtype}_{rows}" for dtype in ("float32", "bfloat16") for rows in (D, P)}
    assert all(v > 0 for v in ms.values())
