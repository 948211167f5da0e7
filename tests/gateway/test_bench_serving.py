"""The serving load generator against a live gateway: it completes, measures, writes JSON and PNG."""
import json

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
