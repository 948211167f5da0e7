"""Timings kept beside the built library (cpu_native.kept_measurement): kept where the machine was quiet
while they were taken, kept only provisionally (for the starts of the next minutes) where other work
shared the CPUs, which /proc/stat tells. Processes measure one at a time, so engines started together
agree on what was measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from kernels import cpu_native


@pytest.fixture
def lib(tmp_path):
    """A stand-in for the loaded library: kept_measurement only reads its path."""
    return SimpleNamespace(path=tmp_path / "matinee-cpu-test.so")


def test_timings_taken_on_a_quiet_machine_are_kept(monkeypatch, lib):
    monkeypatch.setattr(cpu_native, "measured_alone", lambda measure: (measure(), 0.05))
    calls = []
    measure = lambda: calls.append(1) or {"a": 1.0}   # noqa: E731
    assert cpu_native.kept_measurement(".probe.json", "2 threads", measure, lib) == {"a": 1.0}
    assert json.loads(lib.path.with_suffix(".probe.json").read_text()) == {"2 threads": {"a": 1.0}}
    assert cpu_native.kept_measurement(".probe.json", "2 threads", measure, lib) == {"a": 1.0}
    assert len(calls) == 1   # read back, not measured again


def test_timings_taken_beside_other_work_serve_the_starts_of_the_next_minutes_and_are_not_kept(monkeypatch, lib):
    monkeypatch.setattr(cpu_native, "measured_alone", lambda measure: (measure(), 0.6))
    calls = []
    measure = lambda: calls.append(1) or {"a": 9.0 + len(calls)}   # noqa: E731
    assert cpu_native.kept_measurement(".probe.json", "2 threads", measure, lib) == {"a": 10.0}
    assert not lib.path.with_suffix(".probe.json").exists()
    # An engine started beside it takes the same timings (were it to measure again, beside the first
    # one's work, it could choose otherwise: another dtype, a KV the first one cannot share).
    assert cpu_native.kept_measurement(".probe.json", "2 threads", measure, lib) == {"a": 10.0}
    assert len(calls) == 1
    provisional = lib.path.with_suffix(".probe.json.provisional")
    old = time.time() - cpu_native.PROVISIONAL_S - 1
    os.utime(provisional, (old, old))
    assert cpu_native.kept_measurement(".probe.json", "2 threads", measure, lib) == {"a": 11.0}
    assert len(calls) == 2   # a start past the provisional time measures again
    assert not lib.path.with_suffix(".probe.json").exists()


def test_a_busy_share_is_what_other_processes_took():
    """One spinning process per CPU for the whole measurement: well over the limit. The measuring process's
    own CPU time (a spin of its own) is not counted."""
    def spin():
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
    cpus = os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\nwhile time.time() < t: pass"])
                for _ in range(cpus)]
    try:
        time.sleep(0.3)   # the spinners are running
        _, share = cpu_native.measured_alone(lambda: time.sleep(0.5))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert share > cpu_native.BUSY_SHARE
    _, own = cpu_native.measured_alone(spin)
    assert own < share


def test_without_proc_stat_the_machine_counts_as_quiet(monkeypatch):
    monkeypatch.setattr(cpu_native, "_cpu_seconds", lambda: None)
    assert cpu_native.measured_alone(lambda: 7) == (7, 0.0)


MEASURER = """
import json, sys, time
from pathlib import Path
from types import SimpleNamespace
from kernels import cpu_native
share = float(sys.argv[3])
cpu_native.measured_alone = lambda measure: (measure(), share)   # however busy the test machine is
def measure():
    start = time.time()
    time.sleep(0.5)
    return {"start": start, "end": time.time(), "by": sys.argv[4]}
time.sleep(max(float(sys.argv[2]) - time.time(), 0))   # both past their imports: they ask at once
print(json.dumps(cpu_native.kept_measurement(".probe.json", "1 threads", measure, SimpleNamespace(path=Path(sys.argv[1])))))
"""


@pytest.mark.parametrize("share", [0.0, 0.9])
def test_processes_that_start_together_measure_one_at_a_time(lib, share):
    start_at = str(time.time() + 6)
    procs = [subprocess.Popen([sys.executable, "-c", MEASURER, str(lib.path), start_at, str(share), name],
                              stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    results = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]   # after any log line
    # The first one's timings were kept (or, taken beside other work, kept provisionally): the other took
    # them, whichever it was, and measured nothing itself
    assert results[0] == results[1]


def test_a_measurement_may_take_another_inside_it(monkeypatch, lib):
    monkeypatch.setattr(cpu_native, "measured_alone", lambda measure: (measure(), 0.05))
    inner = lambda: {"inner": 1.0}   # noqa: E731
    outer = lambda: {"outer": cpu_native.kept_measurement(".inner.json", "n", inner, lib)["inner"]}   # noqa: E731
    out = {}
    t = threading.Thread(target=lambda: out.update(cpu_native.kept_measurement(".outer.json", "n", outer, lib)),
                         daemon=True)
    t.start()
    t.join(10)
    assert out == {"outer": 1.0}   # not stuck on its own lock


def test_a_burst_of_other_work_spoils_rounds_not_row_counts():
    """Other work that takes the cores for a stretch of a probe (here: a round's worth of calls, 5 ms each)
    slows one round of every row count's runs, and each keeps its best from the other rounds; timed a row
    count at a time, the same stretch would have slowed every round of one row count."""
    calls = []

    def run():
        calls.append(None)
        if 8 <= len(calls) < 16:   # the second round of eight runs (after the warm-up one)
            time.sleep(0.005)

    def runs_at(rows):
        return {"amx": run, "int8": run}

    ms = cpu_native.best_ms_at_rows((8, 16, 32, 64), runs_at, 3)
    assert sorted(ms) == sorted(f"{name}_{rows}" for rows in (8, 16, 32, 64) for name in ("amx", "int8"))
    assert len(calls) == 4 * 8 and max(ms.values()) < 1.0
