"""The dashboard and the planner page: served without a key, their data only with it; the stream's
snapshots; the planner's figure equal to `matinee plan`'s; and both pages in headless Chromium."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.gateway.conftest import API_KEY
from tests.gateway.test_cli_plan import CHAPTER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.environ.get("MATINEE_TEST_ARTIFACTS", os.path.join(ROOT, "build", "test-artifacts"))
CHAPTER_REQUEST = {"model": "70b-gqa", "context_len": 131072, "concurrency": 8, "weight_dtype": "bf16",
                   "kv_dtype": "bf16", "gpu_memory": "80GB", "gpus": 7}


def get(url: str, key: str | None = None, data: dict | None = None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, json.dumps(data).encode() if data is not None else None, headers)
    try:
        r = urllib.request.urlopen(req, timeout=30)
        return r.status, r
    except urllib.error.HTTPError as e:
        return e.code, e


def first_events(url: str, key: str, n: int) -> list[dict]:
    status, r = get(url, key)
    assert status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for line in r:
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
            if len(events) == n:
                r.close()
                return events


def test_pages_need_no_key_and_data_needs_it(tiny_servers):
    base = tiny_servers.main
    for path in ("/dashboard", "/dashboard/plan", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        status, r = get(base + path)
        assert status == 200, path
        assert b"Authorization" not in r.read() or path.endswith(".js")
    status, r = get(base + "/dashboard/auth")
    assert status == 200 and json.load(r) == {"key_required": True}
    assert get(base + "/dashboard/stream")[0] == 401
    assert get(base + "/dashboard/plan/compute", data=CHAPTER_REQUEST)[0] == 401
    assert get(base + "/dashboard/stream", "wrong-key")[0] == 401


def test_stream_snapshots_show_the_engine_and_its_counters(tiny_servers):
    base = tiny_servers.main
    status, r = get(base + "/v1/completions", API_KEY,
                    {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 6, "ignore_eos": True})
    assert status == 200
    first, second = first_events(base + "/dashboard/stream", API_KEY, 2)
    assert first["model"] == "tiny" and first["ready"] is True
    assert 0.9 <= second["t"] - first["t"] <= 3.0
    engine = second["engines"]["0"]
    assert engine["generation_tokens"] >= 6 and engine["kv_blocks_total"] == 512
    assert 0.0 <= engine["kv_usage"] <= 1.0
    assert first["ttft_p50"] is not None and first["ttft_p50"] <= first["ttft_p90"]
    # The engine's own last seconds, measured in the engine (6 tokens: 5 gaps between them).
    assert engine["ttft_p50"] is not None and 0 < engine["ttft_p50"] <= engine["ttft_p90"]
    assert engine["itl_p50"] is not None and 0 < engine["itl_p50"] <= engine["itl_p90"]


def test_the_planner_endpoint_equals_matinee_plan():
    cli = subprocess.run([sys.executable, "-m", "gateway.cli", "plan", *CHAPTER, "--json", "--fit", "--gpus", "7"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    from gateway.planner import PlanRequest, plan_of
    page = plan_of(PlanRequest(**CHAPTER_REQUEST))
    assert page == json.loads(cli.stdout)
    assert page["weight_bytes"] == 140e9 and round(page["kv_bytes"] / 1e8) == 3436
    assert round(page["total_bytes"] / 1e9) == 484 and page["gpus"] == 7


def test_the_planner_endpoint_refuses_bad_input_with_400(tiny_servers):
    url = tiny_servers.main + "/dashboard/plan/compute"
    for body, words in [({"model": "nope"}, "unknown preset"), ({"model": "70b-gqa", "concurrency": 0}, "concurrency"),
                        ({"config": {"hidden_size": 64}}, "Cannot plan"), ({"model": "70b-gqa", "gpu_memory": "x"}, "size"),
                        ({"model": "70b-gqa", "colour": 1}, "Invalid plan request")]:
        status, r = get(url, API_KEY, body)
        assert status == 400, body
        assert words in json.load(r)["error"]["message"], body
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}
    status, r = get(url, API_KEY, {"config": config, "context_len": 8192})
    plan = json.load(r)
    assert status == 200 and plan["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert plan["num_params"] == 8_030_261_248   # Llama-3-8B, as the preset has it


# --- in a browser ------------------------------------------------------------------------------

def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def _console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _load(base: str, stop: threading.Event) -> None:
    """A little steady load: short completions one after another until `stop`."""
    i = 0
    while not stop.is_set():
        get(base + "/v1/completions", API_KEY, {"model": "tiny", "prompt": [7, 8, 9, i % 50 + 10],
                                                "max_tokens": 12, "ignore_eos": True})
        i += 1


@pytest.mark.slow
def test_the_dashboard_in_chromium_moves_with_load(tiny_servers, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base = tiny_servers.main
    os.makedirs(ARTIFACTS, exist_ok=True)
    driver = _chromium()   # first: a skip must not leave the load running into the tests after this one
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(base, stop), daemon=True)
    load.start()
    try:
        driver.get(base + "/dashboard")
        wait = WebDriverWait(driver, 30)
        key = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#key-form input")
                         if d.find_element(By.ID, "key-form").is_displayed() else None)
        key.send_keys(API_KEY)
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")

        def row() -> list[str]:   # read in one script: the table is redrawn every second
            return driver.execute_script(
                "return [...document.querySelectorAll('#engines tbody td')].map((c) => c.textContent)")

        def generated() -> int:
            cells = row()
            return int(cells[-1]) if len(cells) == 11 else -1

        wait.until(lambda d: generated() > 0 and d.find_element(By.ID, "v-tps").text not in ("–", "0"))
        before = generated()
        wait.until(lambda d: generated() > before)
        # The engine's own TTFT and inter-token p50 · p90, each a time, drawn on the charts too.
        wait.until(lambda d: all(c.count(" · ") == 1 and "–" not in c for c in row()[1:3]))
        legend = driver.find_element(By.ID, "legend-ttft").text
        assert "engine 0" in legend and "gateway" in legend and "p90" in legend
        assert driver.find_element(By.ID, "v-ttft").text.endswith("ms") or \
            driver.find_element(By.ID, "v-ttft").text.endswith(" s")
        assert driver.find_element(By.ID, "model").text.startswith("tiny · 1 engine")
        time.sleep(6)   # a few seconds of history on the charts for the screenshot
        shot = os.path.join(ARTIFACTS, "dashboard.png")
        driver.save_screenshot(shot)
        table = os.path.join(ARTIFACTS, "dashboard-engines.png")   # below the fold on a laptop screen
        driver.execute_script("document.getElementById('engines').scrollIntoView()")
        driver.find_element(By.ID, "engines").screenshot(table)
        with capsys.disabled():   # shown on a passing run too
            print(f"\ndashboard screenshots: {shot} {table}")
        assert _console_errors(driver) == []
        # An engine id is the cluster's text, never markup: one shaped as an element shows as text.
        shown = driver.execute_script("""
            const s = structuredClone(history[history.length - 1]);
            s.t += 0.25;
            s.engines = {'<b id="evil">e</b>': Object.values(s.engines)[0]};
            onSnapshot(s);
            return [document.getElementById('evil') === null,
                    document.querySelector('#engines tbody td').textContent,
                    document.getElementById('legend-ttft').textContent]""")
        assert shown[0] and shown[1] == '<b id="evil">e</b>' and '<b id="evil">' in shown[2]
    finally:
        stop.set()
        driver.quit()
        load.join(30)


@pytest.mark.slow
def test_the_plan_page_in_chromium_matches_the_chapter_and_follows_a_slider(tiny_servers, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    os.makedirs(ARTIFACTS, exist_ok=True)
    driver = _chromium()
    try:
        driver.get(tiny_servers.main + "/dashboard/plan")
        driver.execute_script("sessionStorage.setItem('matinee-api-key', arguments[0])", API_KEY)
        driver.refresh()
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: d.find_element(By.ID, "total").get_attribute("data-bytes"))
        cli = json.loads(subprocess.run([sys.executable, "-m", "gateway.cli", "plan", *CHAPTER, "--json"],
                                        capture_output=True, text=True, timeout=60).stdout)
        shown = {k: float(driver.find_element(By.ID, k).get_attribute("data-bytes")) for k in ("weights", "kv", "total")}
        assert shown == {"weights": cli["weight_bytes"], "kv": cli["kv_bytes"], "total": cli["total_bytes"]}
        assert driver.find_element(By.ID, "weights").text.startswith("140.0 GB")
        assert driver.find_element(By.ID, "kv").text.startswith("343.6 GB")
        assert driver.find_element(By.ID, "total").text == "483.9 GB"   # "about 484 GB"
        assert driver.find_element(By.ID, "gpus-needed").get_attribute("data-gpus") == "7"
        shot = os.path.join(ARTIFACTS, "plan.png")
        driver.save_screenshot(shot)
        with capsys.disabled():
            print(f"\nplan page screenshot: {shot}")
        # One step left on the context slider: 64K tokens, half the KV cache.
        slider = driver.find_element(By.ID, "context")
        driver.execute_script("arguments[0].value = +arguments[0].value - 1;"
                              "arguments[0].dispatchEvent(new Event('input'))", slider)
        wait.until(lambda d: float(d.find_element(By.ID, "kv").get_attribute("data-bytes")) == cli["kv_bytes"] / 2)
        assert float(driver.find_element(By.ID, "total").get_attribute("data-bytes")) < cli["total_bytes"]
        assert driver.find_element(By.ID, "o-context").text == "64K tokens"
        assert _console_errors(driver) == []
    finally:
        driver.quit()


def test_an_engine_with_a_kv_tier_shows_its_hits_bytes_and_blocks():
    from actors.messages.front_end import EngineStats
    from actors.messages.kv import KVStats
    from gateway.dashboard import engine_snapshot

    plain = EngineStats(0, 0, 10, 10, 100, 40, 100, 0, 0)
    assert "tier_hits" not in engine_snapshot(plain)
    tiered = EngineStats(0, 0, 10, 10, 100, 40, 100, 0, 0, prefix_cache_tier_hit_tokens=32,
                         kv_tier=KVStats(10, 10, 0, True, 5, tier_bytes_saved=100, tier_bytes_loaded=50,
                                         tier_bytes_pulled=7))
    snap = engine_snapshot(tiered)
    assert (snap["tier_hits"], snap["tier_blocks"], snap["tier_bytes"]) == (32, 5, 157)
