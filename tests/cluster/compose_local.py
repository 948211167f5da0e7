"""Runs compose.yaml's services as local processes: the file is interpolated as compose does,
each replica gets a loopback port for its container port, and every service name in addresses
is mapped to those ports. Images become local programs: ours to `matinee`, redis to
redis-server, nginx to a local nginx with the file's own config."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time

import yaml

from tests.cluster import harness as h

# The port each service's containers listen on (the test checks compose.yaml agrees).
CONTAINER_PORTS = {"redis": 6379, "draft": 7200, "engine": 7100, "gateway": 8000, "lb": 80,
                   "prefill": 7100, "decode": 7100}
# A second port some containers serve: an engine's own /metrics and /ready.
METRICS_PORTS = {"engine": 9100, "prefill": 9100, "decode": 9100}

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""
    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op is not None and op.endswith("?") and unset:
            raise ValueError(f"{name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return value or ""
    return _VAR.sub(sub, text)


def merge(base, override):
    """`docker compose -f base -f override`: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def load(path: str, env: dict[str, str], profiles: tuple[str, ...] = (), overrides: tuple[str, ...] = ()) -> dict:
    """The file (and override files after it) as compose runs it: services of a profile not asked
    for are left out."""
    spec = {}
    for name in (path, *overrides):
        with open(name) as f:
            spec = merge(spec, yaml.safe_load(interpolate(f.read(), env)))
    spec["services"] = {name: svc for name, svc in spec["services"].items()
                        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}
    return spec


class Replica:
    def __init__(self, service: str, index: int, port: int):
        self.service, self.index, self.port = service, index, port
        self.metrics_port = h.free_port() if service in METRICS_PORTS else None
        self.proc: subprocess.Popen | None = None
        self.log_path = ""

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-3000:]


class LocalCompose:
    def __init__(self, spec: dict, workdir, entrypoint: list[str], env: dict[str, str],
                 service_env: dict[str, dict[str, str]], scale: dict[str, int]):
        self.spec, self.workdir, self.entrypoint = spec, workdir, entrypoint
        self.env, self.service_env = env, service_env
        self.replicas: dict[str, list[Replica]] = {}
        for name, svc in spec["services"].items():
            n = scale.get(name, svc.get("deploy", {}).get("replicas", 1))
            self.replicas[name] = [Replica(name, i, h.free_port()) for i in range(n)]

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.replicas[service][0].port}"

    def _map(self, value: str, replica: Replica) -> str:
        """Service names and container ports as this machine's loopback addresses."""
        for name, port in CONTAINER_PORTS.items():
            if self.replicas.get(name):
                value = value.replace(f"{name}:{port}", self.address(name))
        value = value.replace("0.0.0.0", "127.0.0.1")
        if value == str(CONTAINER_PORTS[replica.service]):
            value = str(replica.port)
        if value == str(METRICS_PORTS.get(replica.service)):
            value = str(replica.metrics_port)
        return value

    def _argv(self, svc: dict, replica: Replica) -> list[str]:
        command = [self._map(str(a), replica) for a in svc.get("command", [])]
        image = svc.get("image", "")
        if image.startswith("redis"):   # its data (the volume /data) in the work directory
            data = self.workdir / f"redis-{replica.index}"
            data.mkdir(exist_ok=True)
            return [shutil.which("redis-server"), *command[1:], "--port", str(replica.port), "--bind", "127.0.0.1",
                    "--dir", str(data)]
        if image.startswith("nginx"):
            return self._nginx(svc, replica)
        return [*self.entrypoint, *command]

    def _nginx(self, svc: dict, replica: Replica) -> list[str]:
        root = self.workdir / f"nginx-{replica.index}"
        root.mkdir(exist_ok=True)
        (source,) = [c["source"] for c in svc["configs"]]
        conf = self.spec["configs"][source]["content"]
        gateways = "".join(f"server 127.0.0.1:{r.port} max_fails=1 fail_timeout=5s;\n"
                           for r in self.replicas["gateway"])
        conf = re.sub(r"server gateway:8000[^;]*;\n", gateways, conf)
        conf = conf.replace("listen 80;", f"listen 127.0.0.1:{replica.port};")
        (root / "default.conf").write_text(conf)
        temp = " ".join(f"{k}_temp_path {root}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (root / "nginx.conf").write_text(
            f"daemon off; pid {root}/nginx.pid; error_log {root}/error.log;\n"
            f"events {{}}\nhttp {{ access_log off; {temp} include {root}/default.conf; }}\n")
        return [shutil.which("nginx"), "-p", str(root), "-c", str(root / "nginx.conf")]

    def start_service(self, name: str) -> None:
        svc = self.spec["services"][name]
        for replica in self.replicas[name]:
            # A variable without a value (`KEY:` after interpolation) passes the host's through.
            env = {**self.env, **{k: self._map(str(v), replica) for k, v in svc.get("environment", {}).items()
                                  if v is not None},
                   **self.service_env.get(name, {})}
            replica.log_path = str(self.workdir / f"{name}-{replica.index}.log")
            with open(replica.log_path, "ab") as log:
                replica.proc = subprocess.Popen(self._argv(svc, replica), cwd=h.ROOT, env=env,
                                                stdout=log, stderr=subprocess.STDOUT)

    def healthcheck(self, name: str, replica: Replica) -> bool:
        """The service's own healthcheck command, run against this replica."""
        test = self.spec["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        port = re.compile(rf"(?<![0-9]){CONTAINER_PORTS[name]}(?![0-9])")
        argv = [port.sub(str(replica.port), a).replace("http://127.0.0.1/", f"http://127.0.0.1:{replica.port}/")
                for a in test[1:]]
        if name in METRICS_PORTS:
            metrics = re.compile(rf"(?<![0-9]){METRICS_PORTS[name]}(?![0-9])")
            argv = [metrics.sub(str(replica.metrics_port), a) for a in argv]
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "redis-cli":
            argv[1:1] = ["-p", str(replica.port)]   # options go before the command
        elif argv[0] == "wget" and shutil.which("wget") is None:
            argv = [sys.executable, "-c", f"import urllib.request; urllib.request.urlopen({argv[-1]!r}, timeout=2)"]
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0

    def wait_healthy(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for replica in self.replicas[name]:
            while not self.healthcheck(name, replica):
                if replica.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{name}[{replica.index}] is not healthy:\n{replica.log()}")
                time.sleep(0.5)

    def stop(self, sig=signal.SIGKILL) -> dict[str, list[int | None]]:
        codes = {}
        for name in reversed(list(self.replicas)):
            for r in self.replicas[name]:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.send_signal(sig)
            codes[name] = []
            for r in self.replicas[name]:
                if r.proc is None:
                    codes[name].append(None)
                    continue
                try:
                    codes[name].append(r.proc.wait(60))
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    codes[name].append(r.proc.wait())
        return codes


def start_order(spec: dict) -> list[str]:
    """Services after those they depend on."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in spec["services"][name].get("depends_on", {}):
            visit(dep)
        order.append(name)

    for name in spec["services"]:
        visit(name)
    return order


def dockerfile_entrypoint(path: str) -> list[str]:
    with open(path) as f:
        (line,) = [ln for ln in f if ln.startswith("ENTRYPOINT")]
    return yaml.safe_load(line.split(None, 1)[1])


__all__ = ["CONTAINER_PORTS", "METRICS_PORTS", "LocalCompose", "merge", "dockerfile_entrypoint", "interpolate", "load", "start_order"]
