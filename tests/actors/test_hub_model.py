"""Hub ids through huggingface_hub's cache, laid out here by the test (no network is ever used):
a cached snapshot resolves offline and with the hub unreachable; a missing one fails in one line."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from actors.model.hub import is_hub_id, local_model_path

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lay_out_cache(cache: str, model_folder: str, repo: str = REPO) -> str:
    """huggingface_hub's layout: models--org--name/{refs/main, snapshots/<revision>/...}."""
    repo_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(repo_dir, "snapshots", REVISION)
    shutil.copytree(model_folder, snapshot)
    os.makedirs(os.path.join(repo_dir, "refs"))
    with open(os.path.join(repo_dir, "refs", "main"), "w") as f:
        f.write(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dir):
    cache = str(tmp_path_factory.mktemp("hf-cache"))
    lay_out_cache(cache, tiny_model_dir("llama"))
    return cache


def _resolve(model: str, cache: str, call: str = "local_model_path(sys.argv[1])", **env) -> subprocess.CompletedProcess:
    """In a fresh process: huggingface_hub reads its environment once, at import."""
    code = ("import sys\nfrom actors.model.hub import local_model_path\n"
            "from actors.model.source import resolve_model_source\n"
            f"try:\n    print({call})\n"
            "except ValueError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "HF_HUB_CACHE": cache, **env})


def test_hub_ids_and_paths_are_told_apart(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name")
    for not_id in ("model", "/abs/path", "./rel/path", "a/b/c", "../up", "org/", "~/models"):
        assert not is_hub_id(not_id), not_id
    (tmp_path / "org").mkdir()
    local = tmp_path / "org" / "name"
    local.mkdir()
    os.chdir(tmp_path)
    try:
        assert local_model_path("org/name") == "org/name"   # a folder on disk wins over the hub
    finally:
        os.chdir(ROOT)


def test_a_cached_snapshot_serves_offline(hub_cache):
    done = _resolve(REPO, hub_cache, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path == os.path.join(hub_cache, "models--tiny-org--tiny-llama", "snapshots", REVISION)
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "llama"


def test_every_model_path_takes_a_hub_id(hub_cache):
    """The model source behind the engine's model, a draft model and the tokenizer."""
    done = _resolve(REPO, hub_cache, "resolve_model_source(sys.argv[1])", HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    assert "kind='hf'" in done.stdout and REVISION in done.stdout


def test_a_cached_snapshot_serves_when_the_hub_is_unreachable(hub_cache):
    # Nothing listens on port 9 of loopback: the connection is refused at once.
    done = _resolve(REPO, hub_cache, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(REVISION)


@pytest.mark.parametrize("env, why", [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
                                      ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
                                       "ConnectError")])
def test_a_missing_model_fails_in_one_line_saying_what_to_download_where(hub_cache, env, why):
    done = _resolve("tiny-org/not-downloaded", hub_cache, **env)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert why in line and "hf download tiny-org/not-downloaded" in line and hub_cache in line
