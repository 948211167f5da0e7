"""guidellm, the serving benchmark most vLLM users run, unchanged against a live gateway.

It streams with vLLM's `stream_options.continuous_usage_stats` and reads token counts from the
usage it gets back; every request it sends must succeed, and its counts must be the server's.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from gateway.config import GatewayConfig

pytestmark = pytest.mark.slow

GUIDELLM = shutil.which("guidellm", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(GUIDELLM is None, reason="guidellm is not installed (a test extra)")
@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_requests_all_succeed_with_the_servers_token_counts(
        tiny_servers, tiny_model_folder, tmp_path, request_format):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny"))
    out = tmp_path / "guidellm.json"
    run = subprocess.run(
        [GUIDELLM, "run",
         "--backend", f"kind=openai_http,target={base},request_format={request_format}",
         "--profile", "kind=synchronous",
         "--constraint", "kind=max_requests,count=3",
         "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
         "--tokenizer", f"kind=hf_auto,model={tiny_model_folder}",
         "--output", f"kind=json,path={out}", "--disable-console"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    state = bench["scheduler_state"]
    assert state["successful_requests"] == 3 and state["errored_requests"] == 0, state
    for r in bench["requests"]["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert r["output_tokens"] == 8            # from the usage the server streamed
        assert r["prompt_tokens"] >= 16
