"""compose.yaml: valid under the compose specification, and runnable: each service's command
started as a local process (service names mapped to loopback ports), a request driven through
the load balancer, both gateways and an engine, and a graceful stop."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys

import pytest

from tests.cluster import compose_local as cl
from tests.cluster import harness as h

COMPOSE = os.path.join(h.ROOT, "compose.yaml")
GPU = os.path.join(h.ROOT, "compose.gpu.yaml")
DOCKERFILE = os.path.join(h.ROOT, "Dockerfile")
MONITORING = os.path.join(h.ROOT, "gateway", "monitoring")
REDIS_PASSWORD = "0123456789abcdef"
API_KEY = "compose-api-key"
ENV = {"MATINEE_CLUSTER_SECRET": h.SECRET, "MATINEE_REDIS_PASSWORD": REDIS_PASSWORD, "MATINEE_API_KEY": API_KEY}


def test_interpolation_follows_compose_rules():
    env = {"A": "1", "E": ""}
    assert cl.interpolate("$A ${A} ${B:-x} ${E:-y} ${E-z} $$A", env) == "1 1 x y  $A"
    with pytest.raises(ValueError, match="needed"):
        cl.interpolate("${E:?needed}", env)


def test_compose_file_is_valid_under_the_compose_specification():
    compose_spec = pytest.importorskip("compose_spec")
    spec = cl.load(COMPOSE, ENV)
    parsed = compose_spec.PyCompose.from_json(json.dumps(spec))
    parsed.to_spec()   # the typed model of the whole specification
    assert set(parsed.service_names()) >= {"redis", "engine", "gateway", "lb"}
    broken = json.loads(json.dumps(spec))
    broken["services"]["gateway"]["healthcheck"]["intervall"] = "5s"
    with pytest.raises(ValueError):
        compose_spec.PyCompose.from_json(json.dumps(broken))
    every = cl.load(COMPOSE, ENV, profiles=("draft", "monitoring"), overrides=(GPU,))
    parsed = compose_spec.PyCompose.from_json(json.dumps(every))
    parsed.to_spec()
    assert set(parsed.service_names()) >= {"redis", "engine", "gateway", "lb", "draft", "prometheus", "grafana"}


def test_compose_file_describes_the_cluster():
    for needed in ("MATINEE_CLUSTER_SECRET", "MATINEE_REDIS_PASSWORD"):   # required, never defaulted
        with pytest.raises(ValueError, match=needed):
            cl.load(COMPOSE, {k: v for k, v in ENV.items() if k != needed})
    spec = cl.load(COMPOSE, ENV)
    s = spec["services"]
    assert s["gateway"]["deploy"]["replicas"] == 2
    assert "replicas" not in s["engine"].get("deploy", {})   # scaled with --scale engine=N
    for name in ("gateway", "lb", "engine"):   # "serving", not "the port is open"
        assert "/ready" in " ".join(s[name]["healthcheck"]["test"])
    assert f"127.0.0.1:{s['engine']['environment']['MATINEE_METRICS_PORT']}/ready" in \
        " ".join(s["engine"]["healthcheck"]["test"])
    for name in ("engine", "gateway"):   # the models, read-only, wherever a model or tokenizer loads
        assert any(v.endswith(":/models:ro") for v in s[name]["volumes"]), s[name].get("volumes")
    assert s["engine"]["environment"]["MATINEE_LISTEN_PORT"] == str(cl.CONTAINER_PORTS["engine"])
    assert s["gateway"]["environment"]["MATINEE_PORT"] == str(cl.CONTAINER_PORTS["gateway"])
    assert s["redis"]["command"][-2:] == ["--requirepass", REDIS_PASSWORD]
    assert REDIS_PASSWORD in s["redis"]["healthcheck"]["test"]
    for name in ("engine", "gateway"):
        assert s[name]["environment"]["MATINEE_REDIS_URL"] == f"redis://:{REDIS_PASSWORD}@redis:6379/0"
    assert cl.dockerfile_entrypoint(DOCKERFILE) in (["matinee"], ["python", "-m", "gateway.roles"])
    assert "draft" not in s                                   # optional: only with --profile draft
    draft = cl.load(COMPOSE, ENV, profiles=("draft",))["services"]["draft"]
    assert draft["command"][-2:] == ["--role", "draft"]
    assert draft["environment"]["MATINEE_LISTEN_PORT"] == str(cl.CONTAINER_PORTS["draft"])
    assert "prefill" not in s and "decode" not in s          # optional: only with --profile disagg
    disagg = cl.load(COMPOSE, ENV, profiles=("disagg",))["services"]
    for role in ("prefill", "decode"):
        svc = disagg[role]
        assert svc["command"][-2:] == ["--role", role]
        assert "replicas" not in svc.get("deploy", {})        # scaled with --scale prefill=N
        assert svc["environment"]["MATINEE_LISTEN_PORT"] == str(cl.CONTAINER_PORTS[role])
        assert svc["environment"]["MATINEE_REDIS_URL"] == f"redis://:{REDIS_PASSWORD}@redis:6379/0"
        assert svc["environment"]["MATINEE_METRICS_PORT"] == str(cl.METRICS_PORTS[role])
        assert f"{cl.METRICS_PORTS[role]}/ready" in " ".join(svc["healthcheck"]["test"])


def _published(svc: dict) -> list[tuple[str, str]]:
    """(host address, host port) of each port a service publishes; "" is every interface."""
    out = []
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), str(p.get("published", ""))))
            continue
        parts = str(p).rsplit(":", 2)
        out.append((parts[0], parts[1]) if len(parts) == 3 else ("", parts[0] if len(parts) == 2 else ""))
    return out


def test_nothing_is_published_beyond_loopback_without_a_login():
    """Compose's defaults expose nothing: the API (the load balancer, on every interface) needs a
    key, which compose refuses to start without; Prometheus publishes no port; Grafana listens on
    loopback only, and wants a login (no anonymous viewer)."""
    with pytest.raises(ValueError, match="MATINEE_API_KEY"):
        cl.load(COMPOSE, {k: v for k, v in ENV.items() if k != "MATINEE_API_KEY"})
    for overrides in ((), (GPU,)):
        s = cl.load(COMPOSE, ENV, profiles=("draft", "disagg", "monitoring"), overrides=overrides)["services"]
        everywhere = {name for name, svc in s.items() for host, _ in _published(svc)
                      if host not in ("127.0.0.1", "localhost", "[::1]")}
        assert everywhere == {"lb"}, everywhere
        assert s["gateway"]["environment"]["MATINEE_API_KEY"] == API_KEY
        assert _published(s["prometheus"]) == [] and s["prometheus"]["expose"] == ["9090"]
        assert _published(s["grafana"]) == [("127.0.0.1", "3000")]
        grafana_env = s["grafana"]["environment"]
        assert grafana_env.get("GF_AUTH_ANONYMOUS_ENABLED", "false") == "false"
        assert not any(k.startswith("GF_AUTH_ANONYMOUS_ORG") or k == "GF_AUTH_DISABLE_LOGIN_FORM"
                       for k in grafana_env)
    s = cl.load(COMPOSE, {**ENV, "MATINEE_GRAFANA_PASSWORD": "pw"}, profiles=("monitoring",))["services"]
    assert s["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw"
    with open(os.path.join(MONITORING, "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        assert "http://prometheus:9090" in f.read()   # Grafana reaches it over compose's network


def test_monitoring_profile_scrapes_every_gateway_and_engine_and_provisions_grafana():
    import yaml

    s = cl.load(COMPOSE, ENV, profiles=("monitoring",))["services"]
    assert "prometheus" not in cl.load(COMPOSE, ENV)["services"]   # only with --profile monitoring
    mounts = {v.split(":")[1]: v for v in s["prometheus"]["volumes"]}
    config_path = os.path.join(h.ROOT, mounts["/etc/prometheus/prometheus.yml"].split(":")[0])
    with open(config_path) as f:
        jobs = {j["job_name"]: j for j in yaml.safe_load(f)["scrape_configs"]}
    targets = {(sd["names"][0], sd["port"]) for j in jobs.values() for sd in j["dns_sd_configs"]}
    assert targets == {("gateway", int(s["gateway"]["environment"]["MATINEE_PORT"])),
                       ("engine", int(s["engine"]["environment"]["MATINEE_METRICS_PORT"]))}
    key_file = jobs["matinee-gateway"]["authorization"]["credentials_file"]
    assert any(c["target"] == key_file for c in s["prometheus"]["configs"])   # the API key, when set
    assert cl.load(COMPOSE, {**ENV, "MATINEE_API_KEY": "k3y"})["configs"]["prometheus-api-key"]["content"] == "k3y"
    grafana = {v.split(":")[1]: v for v in s["grafana"]["volumes"]}
    assert all(v.endswith(":ro") for v in grafana.values())
    provisioning = os.path.join(h.ROOT, grafana["/etc/grafana/provisioning"].split(":")[0])
    with open(os.path.join(provisioning, "datasources", "prometheus.yml")) as f:
        (source,) = yaml.safe_load(f)["datasources"]
    assert source["url"] == "http://prometheus:9090"
    with open(os.path.join(provisioning, "dashboards", "matinee.yml")) as f:
        (provider,) = yaml.safe_load(f)["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards" in grafana
    dashboard = grafana_dashboard()
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for word in ("first token", "Inter-token", "tokens/s", "KV cache", "hit rate"):
        assert word in titles, word
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == source["uid"] and p["targets"], p["title"]
        if "by engine" in p["title"]:
            assert all("by (engine)" in t["expr"] or "by (le, engine)" in t["expr"] for t in p["targets"])


def test_gpu_variant_reserves_a_gpu_per_engine_on_the_cuda_image():
    s = cl.load(COMPOSE, ENV, overrides=(GPU,))["services"]
    (device,) = s["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert s["engine"]["environment"]["MATINEE_DEVICE"] == "cuda"
    assert s["engine"]["environment"]["MATINEE_LISTEN_PORT"] == "7100"   # the rest of the engine stays
    assert s["engine"]["build"]["args"]["TORCH_INDEX"] == "" and s["engine"]["image"] != s["gateway"]["image"]
    assert "deploy" not in s["redis"] and s["gateway"]["deploy"] == {"replicas": 2}
    with open(DOCKERFILE) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines   # the CPU image's torch
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    # The kernels compile where they run (-march=native), never for the machine that built the image.
    assert not any("kernels.cpu_native" in ln for ln in lines)


def grafana_dashboard() -> dict:
    with open(os.path.join(MONITORING, "grafana", "dashboards", "matinee.json")) as f:
        return json.load(f)


def dashboard_metric_names() -> set[str]:
    import re
    names = set()
    for p in grafana_dashboard()["panels"]:
        for t in p["targets"]:
            names |= set(re.findall(r"\b((?:vllm:|matinee_)[A-Za-z0-9_:]+)", t["expr"]))
    return names


@pytest.mark.slow
def test_the_compose_stack_serves_a_request_through_every_service(tmp_path, model_dir):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    # With the draft profile: the engine drafts (ngram) on the separate draft service.
    spec = cl.load(COMPOSE, {**ENV, "MATINEE_MODEL": model_dir, "MATINEE_DTYPE": "float32",
                             "MATINEE_SPECULATIVE_METHOD": "ngram", "MATINEE_SPECULATIVE_DRAFT_NODE": "draft"},
                   profiles=("draft", "monitoring"))
    for name in ("prometheus", "grafana"):   # their images are no local programs: their targets are scraped below
        spec["services"].pop(name)
    scale = {"engine": 1}
    if shutil.which("nginx") is None:   # the balancer's image; the rest still runs
        spec["services"].pop("lb")
    env = {**os.environ, "PYTHONPATH": h.ROOT, "OMP_NUM_THREADS": "1"}
    entrypoint = cl.dockerfile_entrypoint(DOCKERFILE)   # the image's own, on this machine's Python
    entrypoint = [sys.executable, "-m", "gateway.cli"] if entrypoint == ["matinee"] else \
        [sys.executable if a == "python" else a for a in entrypoint]
    stack = cl.LocalCompose(spec, tmp_path, entrypoint, env,
                            {"engine": {"MATINEE_NUM_BLOCKS": "256"}}, scale)
    try:
        for name in cl.start_order(spec):
            stack.start_service(name)
            if "healthcheck" in spec["services"][name]:
                stack.wait_healthy(name, timeout=240)
        import redis
        with pytest.raises(redis.AuthenticationError):   # Redis serves only who knows its password
            redis.Redis(port=stack.replicas["redis"][0].port).ping()
        front = "lb" if "lb" in spec["services"] else "gateway"
        base = f"http://{stack.address(front)}"
        for i in range(4):   # nginx alternates between the two gateways
            status, body = h.http_json("POST", base + "/v1/completions",
                                       {"prompt": [5, 6, 7, 8 + i], "max_tokens": 4, "temperature": 0,
                                        "ignore_eos": True}, api_key=API_KEY)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 4
        # A gateway that served nothing has no sample of the counter yet: it served 0.
        served = [h.metric(f"http://127.0.0.1:{r.port}", "matinee_requests_total", API_KEY)
                  for r in stack.replicas["gateway"]]
        served = [0.0 if math.isnan(n) else n for n in served]
        assert sum(served) == 4 and (front == "gateway" or all(n >= 1 for n in served)), served
        # What Prometheus scrapes: every gateway and engine replica, each on its own, and every
        # metric the Grafana dashboard reads is among theirs.
        from prometheus_client.parser import text_string_to_metric_families
        scraped = set()
        ports = [r.port for r in stack.replicas["gateway"]] + [r.metrics_port for r in stack.replicas["engine"]]
        for port in ports:
            status, text = h.http_json("GET", f"http://127.0.0.1:{port}/metrics", api_key=API_KEY)
            assert status == 200, text
            scraped |= {s.name for f in text_string_to_metric_families(str(text)) for s in f.samples}
        assert dashboard_metric_names() <= scraped, dashboard_metric_names() - scraped
        draft_log = stack.replicas["draft"][0].log()
        assert '"draft attached"' in draft_log, draft_log     # the engine drafts on the draft service
    finally:
        codes = stack.stop(signal.SIGTERM)
    assert codes["engine"] == [0], "an engine drains and exits cleanly on SIGTERM"
    assert codes["draft"] == [0], "the draft node exits cleanly on SIGTERM"
    assert codes["gateway"] == [0, 0], "gateways finish and exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("compose-tiny")))
