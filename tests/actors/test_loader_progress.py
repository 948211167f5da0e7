"""Weight loading draws a progress bar on a terminal and writes nothing when stderr is not one."""
from __future__ import annotations

import io

from actors.worker.progress import load_progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_drawn_on_a_terminal_only():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = load_progress(4, "loading model", stream=stream)
        for _ in range(4):
            bar.update()
        bar.close()
    assert pipe.getvalue() == ""
    out = tty.getvalue()
    assert "loading model" in out and "4/4" in out and out.endswith("\n")  # the finished bar stays


def test_runner_load_reports_progress(tiny_model_dir, monkeypatch):
    import sys

    from actors.worker.model_runner import ModelRunner

    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    ModelRunner(tiny_model_dir("llama"), kernels="torch", num_threads=1, num_blocks=4)
    assert "loading tiny-llama" in tty.getvalue() and "4/4" in tty.getvalue()  # embeddings + 3 layers
