"""The serving load generator against a live gateway: it completes, measures, writes JSON and PNG."""
import json
import os

import pytest

from bench import serving
from bench.serving_data import make_requests
from tests.gateway.conftest import API_KEY


def test_datasets_are_seeded_and_shaped():
    a = make_requests("shared-prefix", 20, num_prefixes=3, prefix_len=50, seed=1)
    assert a == make_requests("shared-prefix", 20, num_prefixes=3, prefix_len=50, seed=1)
    assert len({r.messages[0]["content"] for r in a}) <= 3
    mix = make_requests("long-mix", 200, input_len=20, range_ratio=0.0, seed=2)
    longs = sum(r.prompt_words == 160 for r in mix)
    assert 5 <= longs <= 40 and all(r.prompt_words in (20, 160) for r in mix)


def test_percentiles_interpolate():
    p = serving.percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p["p50"] == 3.0 and p["p90"] == 4.6 and p["mean"] == 3.0
    assert serving.percentiles([])["p99"] is None


def test_load_run_against_live_gateway(tiny_servers, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    serving.main(["--url", tiny_servers.main, "--api-key", API_KEY, "--num-prompts", "6",
                  "--input-len", "8", "--output-len", "4", "--range-ratio", "0", "--rates", "50,inf",
                  "--json", str(out), "--plot", str(png), "--label", "tiny"])
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and len(result["runs"]) == 2
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
        assert run["mean_output_tokens"] == 4
        assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"]
        assert run["tpot_s"]["p90"] > 0 and run["req_s"] > 0 and run["output_tok_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_best_rate_under_slo_picks_highest_holding_run():
    from bench.serving_compare import best_rate

    def run(req_s, p90, failed=0):
        return {"req_s": req_s, "failed": failed, "tpot_s": {"p90": p90}}

    result = {"runs": [run(1.0, 0.05), run(2.0, 0.09), run(3.0, 0.2), run(2.5, 0.05, failed=1)]}
    assert best_rate(result, 0.1)["req_s"] == 2.0
    assert best_rate({"runs": [run(1.0, 0.5)]}, 0.1) is None


def test_random_ids_are_exact_token_prompts():
    reqs = make_requests("random-ids", 5, input_len=256, output_len=128, range_ratio=0.0, seed=3,
                         vocab_size=1000)
    assert reqs == make_requests("random-ids", 5, input_len=256, output_len=128, range_ratio=0.0, seed=3,
                                 vocab_size=1000)
    assert all(len(r.prompt_ids) == 256 and r.max_tokens == 128 for r in reqs)
    assert all(100 <= i < 900 for r in reqs for i in r.prompt_ids)


def test_serving_peers_sweep_against_live_gateway(tiny_servers):
    import asyncio

    from bench import serving_peers

    args = serving_peers.build_parser().parse_args(
        ["--concurrency", "1,3", "--input-len", "8", "--output-len", "4", "--min-requests", "2",
         "--vocab-size", "384"])
    runs = asyncio.run(serving_peers.sweep(tiny_servers.main, "tiny", args, {"Authorization": f"Bearer {API_KEY}"}))
    assert [r["concurrency"] for r in runs] == [1, 3]
    assert [r["completed"] for r in runs] == [2, 6] and all(r["failed"] == 0 for r in runs), runs
    for s in map(serving_peers.summary, runs):
        assert s["mean_prompt_tokens"] == 8 and s["mean_output_tokens"] == 4
        assert s["output_tok_s"] > 0 and 0 < s["ttft_p50_s"] <= s["ttft_p90_s"]
        assert 0 < s["itl_p50_s"] <= s["itl_p90_s"]


def _run(level, tok_s, ttft, itl):
    pct = lambda x: {"p50": x, "p90": None if x is None else 2 * x}   # noqa: E731
    return {"concurrency": level, "completed": 8, "failed": 0, "mean_output_tokens": 128,
            "mean_prompt_tokens": 256, "output_tok_s": tok_s, "ttft_s": pct(ttft), "itl_s": pct(itl)}


def test_serving_peers_ratios_are_matinee_over_vllm_per_level():
    from bench.serving_peers import compare, ratios

    ours = [_run(1, 30.0, 0.2, 0.03), _run(8, 120.0, 0.5, None)]
    theirs = [_run(1, 20.0, 0.4, 0.06), _run(8, 60.0, 1.0, 0.1)]
    r = ratios(ours, theirs)
    assert r[0] == {"concurrency": 1, "output_tok_s": 1.5, "ttft_p50_s": 0.5, "ttft_p90_s": 0.5,
                    "itl_p50_s": 0.5, "itl_p90_s": 0.5}
    assert r[1]["output_tok_s"] == 2.0 and r[1]["itl_p50_s"] is None
    results = {"matinee-float32": {"runs": ours}, "matinee-bfloat16": {"runs": ours}, "vllm-bfloat16": {"runs": theirs}}
    assert set(compare(results)) == {"matinee-float32/vllm-bfloat16", "matinee-bfloat16/vllm-bfloat16"}
    import pytest
    with pytest.raises(ValueError, match="levels differ"):
        ratios([_run(1, 1.0, 1.0, 1.0)], [_run(8, 1.0, 1.0, 1.0)])


def test_serving_peers_runs_each_server_in_turn_with_its_flags(tmp_path):
    from bench import peers, serving_peers

    args = serving_peers.build_parser().parse_args(
        ["--peers", "vllm", "--concurrency", "1,8,32", "--dtype", "float32,bfloat16",
         "--vllm-dtype", "bfloat16,float32", "--threads", "2", "--log-dir", str(tmp_path)])
    assert args.concurrency == [1, 8, 32]
    assert [len(serving_peers.level_requests(c, args)) for c in args.concurrency] == [8, 16, 64]
    srvs = serving_peers.servers(args)
    assert [s.label for s in srvs] == ["matinee-float32", "matinee-bfloat16", "vllm-bfloat16", "vllm-float32"]
    m, v = srvs[1], srvs[3]
    assert m.cmd[1:4] == ["-m", "gateway.cli", "serve"] and m.ready_url.endswith("/ready")
    assert m.cmd[m.cmd.index("--dtype") + 1] == "bfloat16" and m.cmd[m.cmd.index("--num-threads") + 1] == "2"
    assert m.cmd[m.cmd.index("--port") + 1] == str(m.port)
    assert v.cmd[:4] == [peers.VLLM_PYTHON, "-P", "-m", "vllm.entrypoints.openai.api_server"]
    assert v.cwd != peers.ROOT   # from the repository, vLLM would import Matinee's kernels/ as `kernels`
    assert v.cmd[v.cmd.index("--dtype") + 1] == "float32" and v.cmd[v.cmd.index("--model") + 1] == peers.VLLM_MODEL
    assert v.ready_url == f"http://127.0.0.1:{v.port}/health"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == peers.VLLM_OMP_BIND and v.env["HF_HUB_OFFLINE"] == "1"
    only = serving_peers.build_parser().parse_args(["--peers", "none"])
    assert [s.label for s in serving_peers.servers(only)] == ["matinee-auto"]
    import pytest
    for bad in (["--concurrency", "0,8"], ["--dtype", "fp8"], ["--peers", "sglang"]):
        with pytest.raises(SystemExit):
            serving_peers.build_parser().parse_args(bad)


def test_serving_peers_runs_llamacpp_on_matinees_gguf_with_a_slot_per_stream(tmp_path):
    from actors.model.source import default_model_path
    from bench import peers, serving_peers

    args = serving_peers.build_parser().parse_args(
        ["--peers", "llamacpp", "--concurrency", "1,8,32", "--quantization", "none", "--log-dir", str(tmp_path)])
    m, llama = serving_peers.servers(args)
    assert m.label == "matinee-auto-none" and m.cmd[m.cmd.index("--quantization") + 1] == "none"
    assert llama.label == "llamacpp-t2" and llama.cmd[0] == peers.LLAMACPP_SERVER
    flag = lambda name: llama.cmd[llama.cmd.index(name) + 1]   # noqa: E731
    assert flag("-m") == default_model_path() and flag("-t") == "2" and flag("-np") == "32"
    assert int(flag("-c")) == 32 * peers.LLAMACPP_SLOT_TOKENS and flag("--port") == str(llama.port)
    assert llama.ready_url == f"http://127.0.0.1:{llama.port}/health"
    results = {"matinee-auto": {"runs": [_run(1, 30.0, 0.2, 0.03)]}, "llamacpp-t2": {"runs": [_run(1, 20.0, 0.4, 0.06)]}}
    assert set(serving_peers.compare(results)) == {"matinee-auto/llamacpp-t2"}


def test_vllm_env_leaves_threads_to_vllm():
    from bench.peers import vllm_env

    env = vllm_env("auto", base={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "PATH": "/bin"},
                   python="/nonexistent/bin/python")
    assert "OMP_WAIT_POLICY" not in env and "OMP_NUM_THREADS" not in env and env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert all(os.path.exists(p) for p in env.get("LD_PRELOAD", "").split(":") if p)


def test_reap_stops_what_a_vllm_session_leaves(tmp_path):
    """A process named like vLLM's workers, left behind in a session, is found and stopped."""
    import subprocess
    import time

    from bench.peers import reap_vllm, vllm_processes

    leader = subprocess.Popen(["bash", "-c", "(exec -a VLLM::Worker sleep 300) & echo $!; wait"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(leader.stdout.readline())
    deadline = time.monotonic() + 10
    while worker not in vllm_processes(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker in vllm_processes(leader.pid)
    assert reap_vllm(leader.pid, grace=10) == [worker]
    assert vllm_processes(leader.pid) == []
    leader.wait(10)


def test_server_lifecycle_with_a_real_process(tmp_path):
    import sys

    from bench.peers import Server, free_port

    port = free_port()
    srv = Server("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                 dict(os.environ), "/", port, str(tmp_path / "http.log"))
    with srv:
        proc = srv.proc
        assert proc.poll() is None
    assert proc.poll() is not None and srv.proc is None


async def test_the_benchmarks_stream_reader_yields_events_and_raises_on_an_error_event():
    import aiohttp
    from aiohttp import web

    from bench.cluster import StreamError, sse_events

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b': ping\n\ndata: {"choices": [{"text": "a"}]}\n\n')
        last = b'data: {"error": {"message": "boom"}}\n\n' if request.query.get("fail") else b"data: [DONE]\n\n"
        await resp.write(last)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/s", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/s") as r:
                assert [ev async for ev in sse_events(r)] == [{"choices": [{"text": "a"}]}]
            async with session.get(base + "/s?fail=1") as r:
                seen = []
                with pytest.raises(StreamError, match="boom"):
                    async for ev in sse_events(r):
                        seen.append(ev)
                assert seen == [{"choices": [{"text": "a"}]}]
    finally:
        await runner.cleanup()


async def test_the_load_generator_survives_a_server_that_drops_kept_alive_connections():
    """llama-server closes a kept-alive connection when the next request arrives on it; the load generator
    opens a connection per request, so none of its requests fails for that."""
    import asyncio

    from bench.serving_data import Request

    body = (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
            b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    served, dropped = [], []

    async def one_request_per_connection(reader, writer):
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            if not first:   # a second request on a kept-alive connection: dropped unanswered
                dropped.append(1)
                writer.close()
                return
            first = False
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            await writer.drain()
            served.append(1)

    server = await asyncio.start_server(one_request_per_connection, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        reqs = [Request(messages=[], max_tokens=2, prompt_words=3, prompt_ids=[1, 2, 3]) for _ in range(4)]
        run = await serving.run_load(base, "m", reqs, rate=None, concurrency=1, headers={}, ignore_eos=True,
                                     seed=0, slo_ttft=1.0, slo_tpot=1.0)
    assert run["completed"] == 4 and run["failed"] == 0, run["errors"]
    assert len(served) == 4 and not dropped
