"""`matinee serve`: flags, and a real server process that prints a working curl line."""
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from gateway import cli
from gateway.config import GatewayConfig
from tests.gateway import http_util as http


def test_defaults_and_flags():
    a = cli.build_parser().parse_args(["serve"])
    assert (a.host, a.port, a.role, a.model, a.api_key) == ("127.0.0.1", 8000, "all", None, None)
    a = cli.build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--no-prefix-caching",
                                       "--max-waiting", "3", "--role", "gateway"])
    kw = cli.engine_kwargs(a)
    assert kw["kv_cache_memory"] == 2 << 30 and kw["enable_prefix_caching"] is False
    assert cli.parse_bytes("512MB") == 512 << 20 and cli.parse_bytes("1000") == 1000
    from gateway import flags
    from gateway.engine_pool import PoolConfig
    assert flags.build(PoolConfig, a).prefix_pull is True
    a = cli.build_parser().parse_args(["serve", "--role", "gateway", "--routing", "least_loaded", "--no-prefix-pull"])
    assert (flags.build(PoolConfig, a).routing, flags.build(PoolConfig, a).prefix_pull) == ("least_loaded", False)
    a = cli.build_parser().parse_args(["serve", "--speculative-method", "ngram", "--speculative-draft-node", "d1"])
    assert cli.engine_kwargs(a)["speculative"]["draft_node"] == "d1"


def test_roles_need_their_setup(capsys, monkeypatch):
    monkeypatch.setenv("MATINEE_CLUSTER_SECRET", "s")
    assert cli.main(["serve", "--role", "draft"]) == 2
    assert "--role draft needs --speculative-method" in capsys.readouterr().err
    assert cli.main(["serve", "--role", "draft", "--speculative-method", "layerskip",
                     "--speculative-draft-layers", "2"]) == 2
    assert "runs inside the engine" in capsys.readouterr().err
    monkeypatch.delenv("MATINEE_CLUSTER_SECRET", raising=False)
    assert cli.main(["serve", "--role", "draft", "--speculative-method", "ngram"]) == 2
    assert "MATINEE_CLUSTER_SECRET" in capsys.readouterr().err
    assert cli.main(["serve", "--role", "engine"]) == 2
    assert "MATINEE_CLUSTER_SECRET" in capsys.readouterr().err
    monkeypatch.setenv("MATINEE_CLUSTER_SECRET", "s")
    assert cli.main(["serve", "--role", "gateway", "--batch-dir", "/tmp/b"]) == 2   # batches live in Redis
    assert "--batch-dir is for `matinee serve --role all`" in capsys.readouterr().err
    assert cli.main(["serve", "--role", "gateway", "--batch-lease", "0"]) == 2
    assert "batch_lease_s must be positive" in capsys.readouterr().err


def test_bad_config_is_a_clear_error(capsys):
    assert cli.main(["serve", "--model", "/no/such/model"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError):
        GatewayConfig(max_waiting=0)


def test_curl_line_names_the_key_variable_never_the_key():
    line = cli.curl_line(GatewayConfig(port=9, api_key=["sk-first", "sk-second"]), "m")
    assert "sk-first" not in line and "sk-second" not in line
    parts = shlex.split(line)
    assert parts[:2] == ["curl", "http://127.0.0.1:9/v1/chat/completions"]
    assert "Authorization: Bearer $MATINEE_API_KEY" in parts   # in double quotes: the shell expands it
    assert json.loads(parts[-1])["model"] == "m"
    assert "Authorization" not in cli.curl_line(GatewayConfig(port=9), "m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "sk-never-print-7f3a9c"


@pytest.mark.slow
def test_serve_process_prints_working_curl_without_the_key_and_stops_on_sigterm(tiny_model_folder):
    """The curl line works when pasted into a shell that has $MATINEE_API_KEY, and nothing the
    process writes (stdout, stderr: the log and the access log, at DEBUG) holds a configured key."""
    port = _free_port()
    env = {**os.environ, "MATINEE_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", tiny_model_folder, "--port",
         str(port), "--num-blocks", "64", "--max-num-seqs", "4", "--served-model-name", "tiny",
         "--log-level", "DEBUG"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    output = []
    try:
        curl = None
        deadline = time.monotonic() + 240
        while curl is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "matinee serve exited early"
            output.append(line)
            if line.strip().startswith("curl "):
                curl = line.strip()
        assert curl is not None
        assert http.get(f"http://127.0.0.1:{port}/ready").status_code == 200
        body = shlex.split(curl)[-1]
        short = json.dumps({**json.loads(body), "max_tokens": 3})
        pasted = curl.replace(f"'{body}'", f"'{short}'") + " -s -w '\\n%{http_code}'"
        run = lambda environ: subprocess.run(["bash", "-c", pasted], env=environ, capture_output=True,
                                             text=True, timeout=120).stdout.rsplit("\n", 1)
        answer, status = run({**os.environ, "MATINEE_API_KEY": KEY})
        assert status == "200" and json.loads(answer)["choices"][0]["message"]["role"] == "assistant"
        _, status = run({k: v for k, v in os.environ.items() if k != "MATINEE_API_KEY"})
        assert status == "401"   # the line really depends on the variable
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        output.append(rest)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(output)
    assert "GET" in text and "/ready" in text   # the access log is in what was read
    assert KEY not in text


def test_speculative_disable_batch_size_flag():
    parse = cli.build_parser().parse_args
    for flag, want in ((None, None), ("none", None), ("6", 6)):
        argv = ["serve", "--speculative-method", "ngram"] + (["--speculative-disable-batch-size", flag] if flag else [])
        assert cli.engine_kwargs(parse(argv))["speculative"]["disable_batch_size"] == want
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-disable-batch-size", "lots"])
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-disable-batch-size", "auto"])


# Every flag of `matinee serve`, so a renamed or dropped one fails here.
FLAGS = """--role --log-level --host --port --api-key --served-model-name --max-waiting --max-body-bytes
--ping-interval --read-timeout --model --dtype --device --quantization --kernels --block-size --num-blocks --kv-cache-memory
--max-num-seqs --max-num-batched-tokens --max-model-len --no-prefix-caching --scheduling-policy --num-threads
--speculative-method --num-speculative-tokens --speculative-model --speculative-draft-layers
--speculative-disable-batch-size --speculative-draft-node --redis-url --listen-host --listen-port --advertise
--engine-id --drain-grace --registry-ttl --metrics-port --kv-transfer-window --kv-transfer-chunk
--no-kv-transfer-by-layer --index-timeout
--routing --no-prefix-pull --max-migrations --local-prefill-tokens --api-key-file --allowed-origins --disable-access-log --chat-template
--tool-call-parser --reasoning-parser --max-tokens-default --max-tokens-limit --max-grammar-chars --grammar-timeout
""".split()
FLAGS += ["--kv-cache-dtype", "--decode-burst", "--enforce-eager"]
FLAGS += ["--response-store-entries", "--response-store-memory", "--response-store-ttl"]
FLAGS += ["--kv-offload-memory", "--kv-offload-dir", "--kv-offload-disk", "--kv-offload-dtype"]
FLAGS += ["--batch-dir", "--batch-max-file-bytes", "--batch-max-lines", "--batch-concurrency", "--batch-file-ttl",
          "--batch-ttft-objective", "--batch-itl-objective", "--batch-step-slack", "--batch-lease",
          "--batch-retention"]
FLAGS += ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--enable-lora-runtime-updates"]
FLAGS += ["--tensor-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--tp-all-reduce"]
FLAGS += ["--batch-invariant"]


def _serve_flags(parser) -> list[str]:
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]
    return [s for a in serve._actions for s in a.option_strings if s not in ("-h", "--help")]


def test_each_config_field_with_help_is_a_flag_with_its_default():
    from gateway import flags

    assert sorted(_serve_flags(cli.build_parser({}))) == sorted(FLAGS)
    defaults = cli.build_parser({}).parse_args(["serve"])
    for _, classes in cli.SECTIONS:
        for cls in classes:
            for f in flags.flag_fields(cls):
                parsed = getattr(defaults, flags.dest(f))
                assert (not parsed if f.type == "bool" and f.default is True else parsed) == flags.default(f), f.name
    assert not any("secret" in name for name in FLAGS)   # the cluster secret: environment only


def test_a_new_field_with_help_becomes_a_flag_and_an_environment_variable():
    import argparse

    from gateway import flags

    @dataclasses.dataclass
    class Knobs:
        new_knob: int = dataclasses.field(default=7, metadata={"help": "a knob"})
        budget: int = dataclasses.field(default=1 << 20, metadata={"help": "bytes", "type": "bytes"})
        internal: float = 1.0

    def parse(argv, environ):
        p = argparse.ArgumentParser()
        flags.add_flags(p, Knobs, environ)
        return flags.build(Knobs, p.parse_args(argv))

    assert parse([], {}) == Knobs()
    assert parse(["--new-knob", "9", "--budget", "2KiB"], {}) == Knobs(new_knob=9, budget=2048)
    assert parse([], {"MATINEE_NEW_KNOB": "3", "MATINEE_BUDGET": ""}) == Knobs(new_knob=3)
    with pytest.raises(SystemExit):
        parse(["--internal", "2"], {})


def test_environment_sets_the_defaults(capsys):
    env = {"MATINEE_KV_CACHE_MEMORY": "2GiB", "MATINEE_NO_PREFIX_CACHING": "1", "MATINEE_API_KEY": "",
           "MATINEE_ROUTING": "round_robin", "MATINEE_SPECULATIVE_METHOD": "ngram", "MATINEE_DRAIN_GRACE": "5"}
    a = cli.build_parser(env).parse_args(["serve"])
    kw = cli.engine_kwargs(a)
    assert (kw["kv_cache_memory"], kw["enable_prefix_caching"], a.api_key) == (2 << 30, False, None)
    assert (a.routing, kw["speculative"]["method"], a.drain_grace) == ("round_robin", "ngram", 5.0)
    assert cli.build_parser(env).parse_args(["serve", "--routing", "kv"]).routing == "kv"   # the flag wins
    with pytest.raises(ValueError, match="MATINEE_ROUTING='x' is not one of"):
        cli.build_parser({"MATINEE_ROUTING": "x"})


def test_a_bad_value_is_one_line_and_exit_2(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "matinee serve: error: argument --port: invalid int value: 'x'" and len(err) == 2
    monkeypatch.setenv("MATINEE_KV_CACHE_MEMORY", "lots")
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err == ("matinee serve: MATINEE_KV_CACHE_MEMORY='lots': not a size: 'lots' "
                                       "(try 2GiB or 536870912)\n")


def test_the_role_runners_never_import_the_cli():
    import gateway.roles

    assert "gateway.cli" not in open(gateway.roles.__file__).read()


def test_help_never_shows_the_api_key_from_the_environment():
    parser = cli.build_parser({"MATINEE_API_KEY": "sk-do-not-print", "MATINEE_PORT": "9123"})
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]
    text = serve.format_help()
    assert "sk-do-not-print" not in text and "$MATINEE_API_KEY" in text
    assert "9123" in text   # other defaults are still shown
    assert parser.parse_args(["serve"]).api_key == ["sk-do-not-print"]
