"""A disk KV tier on a disk that fills up, in a real `matinee serve` process: its directory is a tmpfs a
few blocks big (mounted in a mount namespace of the engine's own, so no privilege is needed). Writes
fail with ENOSPC, every request is still answered with its greedy text, and the tier then keeps to
what the disk holds: oldest files make room, and evicted prompts come back from disk again."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cluster import harness as h
from tests.cluster.test_kv_tier_restart import complete, model  # noqa: F401  (the module's tiny model)

pytestmark = pytest.mark.slow

TMPFS_KIB = 160   # tier.json and nine block files of a 16 KiB page footprint (12,352 bytes each)


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class FullDiskNode(h.Node):
    """The engine in a mount namespace where `tier` is a tmpfs of `TMPFS_KIB`."""

    def __init__(self, args: list[str], log_path: str, tier: str):
        super().__init__(args, log_path)
        self.tier = tier

    def start(self) -> FullDiskNode:
        log = open(self.log_path, "ab")
        mount = f'mount -t tmpfs -o size={TMPFS_KIB}k tmpfs "$0" && exec "$@"'
        self.proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", mount, self.tier, sys.executable, "-m",
                                      "gateway.cli", "serve", *self.args],
                                     cwd=h.ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self


def prompt(k: int) -> str:
    return " ".join(f"t{k}w{i}" for i in range(28))


@pytest.mark.skipif(not _namespaces_work(), reason="needs `unshare -rm` (user and mount namespaces)")
def test_a_full_disk_costs_only_recomputes_and_the_tier_keeps_to_it(model, tmp_path):  # noqa: F811
    tier = tmp_path / "tier"
    tier.mkdir()
    port = h.free_port()
    node = FullDiskNode(["--role", "all", "--model", model, "--served-model-name", "tiny", "--dtype", "float32",
                         "--port", str(port), "--num-blocks", "12", "--max-num-batched-tokens", "128",
                         "--kv-offload-dir", str(tier)], str(tmp_path / "engine.log"), str(tier)).start()
    base = f"http://127.0.0.1:{port}"
    try:
        h.wait_until(lambda: h.http_json("GET", base + "/v1/models", timeout=2)[0] == 200, 180, "the server", [node])
        texts = {k: complete(base, prompt(k))[0] for k in range(5)}   # each evicts the one before to disk
        h.wait_until(lambda: h.metric(base, "matinee_kv_tier_write_failures_total") >= 1, 30,
                     "a write failing on the full disk", [node])
        disk_hits = h.metric(base, "matinee_kv_tier_hit_blocks_disk_total")
        for k in (5, 6):
            texts[k] = complete(base, prompt(k))[0]
        again, cached = complete(base, prompt(5))   # evicted by prompt 6: its blocks were written after the fill
        assert again == texts[5] and cached > 0
        assert h.metric(base, "matinee_kv_tier_hit_blocks_disk_total") > disk_hits
        assert 0 < h.metric(base, "matinee_kv_tier_disk_bytes") <= TMPFS_KIB * 1024
        for k in range(7):
            assert complete(base, prompt(k))[0] == texts[k]
    finally:
        assert node.terminate() == 0, node.log()
