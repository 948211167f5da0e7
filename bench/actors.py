"""Actor runtime benchmark: in-process tell/ask, and tell/ask over loopback TCP between two processes.

`python -m bench.actors [--json]`. Bare asyncio peers (queue puts, a future round trip, a raw
Protocol echo round trip) run in the same process, so the runtime's own cost can be read off."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time

import msgspec
import struct

from runtime import Actor, ActorSystem, configure_logging, register_messages
from runtime.loop import run, using_uvloop

SECRET = "bench-secret"
_HEADER = struct.Struct(">I")


class BenchPing(msgspec.Struct, tag=True, array_like=True, gc=False):
    n: int


class BenchCount(msgspec.Struct, tag=True, array_like=True):
    pass


class BenchCpu(msgspec.Struct, tag=True, array_like=True):
    """Reply: the far process's CPU seconds so far (to split the cost between the two ends)."""


register_messages(BenchPing, BenchCount, BenchCpu)


class Counter(Actor):
    def __init__(self) -> None:
        self.count = 0

    async def receive(self, msg):
        match msg:
            case BenchPing():
                self.count += 1
                return msg.n
            case BenchCount():
                return self.count
            case BenchCpu():
                return time.process_time()


def percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def tell_rate(ref, n: int, batch: int = 1024) -> float:
    """Messages/s from the first tell until the actor has handled the last one."""
    start_count = await ref.ask(BenchCount())
    msg = BenchPing(1)
    t0 = time.perf_counter()
    tell = ref.tell
    for i in range(0, n, batch):
        for _ in range(min(batch, n - i)):
            tell(msg)
        await asyncio.sleep(0)   # a real sender yields now and then
    count = await ref.ask(BenchCount())
    dt = time.perf_counter() - t0
    assert count - start_count == n, (count, start_count, n)
    return n / dt


async def ask_latencies(ref, n: int) -> list[float]:
    msg = BenchPing(1)
    for _ in range(min(n, 1000)):   # warm up
        await ref.ask(msg)
    out = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t0 = pc()
        await ref.ask(msg)
        out.append((pc() - t0) / 1000)
    return out


# ---- bare asyncio peers -------------------------------------------------------------------
async def peer_queue_puts(n: int) -> float:
    q: asyncio.Queue = asyncio.Queue()
    t0 = time.perf_counter()
    for i in range(n):
        q.put_nowait(i)
    return n / (time.perf_counter() - t0)


async def peer_future_roundtrip(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    async def server():
        while True:
            fut = await inbox.get()
            fut.set_result(None)

    task = loop.create_task(server())
    out = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t0 = pc()
        fut = loop.create_future()
        inbox.put_nowait(fut)
        await fut
        out.append((pc() - t0) / 1000)
    task.cancel()
    return out


class _EchoProto(asyncio.Protocol):
    """Echoes bytes back; after a b"S" first byte it instead counts 16-byte frames and answers
    the count to an empty frame (the bare one-way streaming peer)."""

    def connection_made(self, transport):
        self.transport = transport
        self.stream = None
        self.count = 0

    def data_received(self, data):
        if self.stream is None and data[:1] == b"S":
            self.stream = bytearray()
            data = data[1:]
        if self.stream is None:
            self.transport.write(data)
            return
        buf = self.stream
        buf += data
        pos, n, unpack = 0, len(buf), _HEADER.unpack_from
        while n - pos >= 4:
            size = unpack(buf, pos)[0]
            if n - pos - 4 < size:
                break
            pos += 4 + size
            if size == 0:
                self.transport.write(_HEADER.pack(self.count))
            else:
                self.count += 1
        del buf[:pos]


class _PingProto(asyncio.Protocol):
    def __init__(self):
        self.waiter = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(data)


class _StreamProto(asyncio.Protocol):
    def __init__(self):
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if not self.done.done():
            self.done.set_result(_HEADER.unpack_from(data)[0])


async def peer_stream_rate(port: int, n: int, batch: int = 1024) -> float:
    """Bare asyncio one-way throughput of 12-byte payloads in length-prefixed frames."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_StreamProto, "127.0.0.1", port)
    transport.write(b"S")
    payload, pack = b"x" * 12, _HEADER.pack
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        out = bytearray()
        for _ in range(min(batch, n - i)):
            out += pack(12)
            out += payload
        transport.write(out)
        await asyncio.sleep(0)
    transport.write(pack(0))
    count = await proto.done
    dt = time.perf_counter() - t0
    transport.close()
    assert count == n, (count, n)
    return n / dt


async def peer_loopback_rtt(port: int, n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_PingProto, "127.0.0.1", port)
    out = []
    pc = time.perf_counter_ns
    for i in range(n + 500):
        t0 = pc()
        proto.waiter = loop.create_future()
        transport.write(b"12345678")
        await proto.waiter
        if i >= 500:
            out.append((pc() - t0) / 1000)
    transport.close()
    return out


# ---- the far node ---------------------------------------------------------------------------
async def serve() -> int:
    configure_logging("WARNING", json=True)
    system = ActorSystem("bench-far", listen=("127.0.0.1", 0), secret=SECRET)
    await system.start()
    system.install_signal_handlers()
    await system.spawn(Counter(), name="counter")
    raw = await asyncio.get_running_loop().create_server(_EchoProto, "127.0.0.1", 0)
    print("READY", system.address, raw.sockets[0].getsockname()[1], flush=True)
    code = await system.terminated
    raw.close()
    return code


async def measure(args) -> dict:
    configure_logging("WARNING", json=True)
    result: dict = {}
    system = ActorSystem("bench", secret=SECRET)
    await system.start()
    ref = await system.spawn(Counter(), name="counter")
    rates = [await tell_rate(ref, args.tells) for _ in range(args.repeat)]
    result["tell_per_s"] = max(rates)
    lat = await ask_latencies(ref, args.asks)
    result["ask_p50_us"] = percentile(lat, 0.5)
    result["ask_p99_us"] = percentile(lat, 0.99)

    env = dict(os.environ, PYTHONPATH=os.getcwd())
    far = subprocess.Popen([sys.executable, "-m", "bench.actors", "--serve"], stdout=subprocess.PIPE, env=env)
    try:
        words = far.stdout.readline().decode().split()
        address, raw_port = words[1], int(words[2])
        remote = system.remote_ref(address, "counter")
        await system.connect(address)
        far0, near0 = await remote.ask(BenchCpu()), time.process_time()
        lat = await ask_latencies(remote, args.asks)
        far1, near1 = await remote.ask(BenchCpu()), time.process_time()
        n = args.asks + min(args.asks, 1000)
        result["tcp_ask_cpu_us"] = {"asker": (near1 - near0) / n * 1e6, "replier": (far1 - far0) / n * 1e6}
        result["tcp_ask_p50_us"] = percentile(lat, 0.5)
        result["tcp_ask_p99_us"] = percentile(lat, 0.99)
        rates = []
        for _ in range(args.repeat):
            far0, near0 = await remote.ask(BenchCpu()), time.process_time()
            rates.append(await tell_rate(remote, args.tcp_tells))
            far1, near1 = await remote.ask(BenchCpu()), time.process_time()
        result["tcp_tell_per_s"] = max(rates)
        # CPU per message at each end (last run): what the rate would be on two idle cores.
        result["tcp_tell_cpu_us"] = {"sender": (near1 - near0) / args.tcp_tells * 1e6,
                                     "receiver": (far1 - far0) / args.tcp_tells * 1e6}
        far0, near0 = await remote.ask(BenchCpu()), time.process_time()
        rtt = await peer_loopback_rtt(raw_port, args.asks)
        far1, near1 = await remote.ask(BenchCpu()), time.process_time()
        n = args.asks + 500
        rtt_cpu = {"asker": (near1 - near0) / n * 1e6, "replier": (far1 - far0) / n * 1e6}
        stream = max([await peer_stream_rate(raw_port, args.tcp_tells) for _ in range(args.repeat)])
    finally:
        far.terminate()
        far.wait(10)
        await system.shutdown()
    fut = await peer_future_roundtrip(args.asks)
    result["peer"] = {
        "asyncio_queue_put_per_s": max([await peer_queue_puts(args.tells) for _ in range(args.repeat)]),
        "future_roundtrip_p50_us": percentile(fut, 0.5),
        "loopback_rtt_p50_us": percentile(rtt, 0.5),
        "loopback_rtt_cpu_us": rtt_cpu,
        "loopback_stream_per_s": stream,
    }
    result["uvloop"] = using_uvloop()
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tells", type=int, default=500_000)
    p.add_argument("--tcp-tells", type=int, default=300_000)
    p.add_argument("--asks", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5, help="throughput runs; the best is reported")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return run(serve())
    r = run(measure(args))
    if args.json:
        print(json.dumps(r))
        return 0
    peer = r["peer"]
    print(f"in-process tell      {r['tell_per_s']:>12,.0f} msg/s   (target >= 1,000,000; "
          f"bare Queue.put_nowait {peer['asyncio_queue_put_per_s']:,.0f}/s)")
    print(f"in-process ask       p50 {r['ask_p50_us']:6.1f} us  p99 {r['ask_p99_us']:6.1f} us   "
          f"(target p50 <= 15; bare future round trip p50 {peer['future_roundtrip_p50_us']:.1f} us)")
    print(f"TCP ask (2 procs)    p50 {r['tcp_ask_p50_us']:6.1f} us  p99 {r['tcp_ask_p99_us']:6.1f} us   "
          f"(target p50 <= 100; bare loopback echo p50 {peer['loopback_rtt_p50_us']:.1f} us)")
    acpu, tcpu = r["tcp_ask_cpu_us"], r["tcp_tell_cpu_us"]
    pcpu = peer["loopback_rtt_cpu_us"]
    print(f"                     CPU per ask: asker {acpu['asker']:.1f} us, replier {acpu['replier']:.1f} us "
          f"(bare echo: {pcpu['asker']:.1f} us, {pcpu['replier']:.1f} us)")
    print(f"TCP tell (2 procs)   {r['tcp_tell_per_s']:>12,.0f} msg/s   (target >= 200,000; bare framed stream "
          f"{peer['loopback_stream_per_s']:,.0f}/s)")
    print(f"                     CPU per message: sender {tcpu['sender']:.2f} us, receiver {tcpu['receiver']:.2f} us")
    print(f"event loop: {'uvloop' if r['uvloop'] else 'asyncio'}; {r['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
