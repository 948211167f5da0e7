"""`matinee serve --model org/name` in a real process, offline, from a hub cache laid out here."""
import os
import subprocess
import sys
import time

import pytest

from tests.actors.test_hub_model import REPO, lay_out_cache
from tests.gateway import http_util as http
from tests.gateway.test_cli import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_a_hub_id_is_served_from_the_cache_and_named_by_it(tmp_path, tiny_model_folder):
    cache = str(tmp_path / "hf-cache")
    lay_out_cache(cache, tiny_model_folder)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", REPO, "--port", str(port),
         "--num-blocks", "64", "--max-num-seqs", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
        env={**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, "matinee serve exited early"
            try:
                if http.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        models = http.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [REPO]
        assert models[0]["root"].startswith(cache)
        r = http.post(f"http://127.0.0.1:{port}/v1/completions",
                      json_body={"model": REPO, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == REPO
    finally:
        proc.terminate()
        proc.wait(60)
