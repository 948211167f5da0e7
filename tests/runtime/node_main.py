"""A small node for the cross-process tests: `python -m tests.runtime.node_main --secret S`.

Prints `READY <address>` once listening, serves an `echo` actor, exits on SIGTERM."""
import argparse
import asyncio
import sys

from runtime import Actor, ActorSystem, Supervision, configure_logging
from runtime.loop import run
from tests.runtime.wire_messages import (RtEcho, RtFail, RtForward, RtGetSeen, RtPlain, RtSeq,
                                         RtSleep, RtStop)


class EchoActor(Actor):
    def __init__(self):
        self.seen: dict[int, list[int]] = {}

    async def receive(self, msg):
        match msg:
            case RtEcho(value=v):
                return RtEcho(v + 1)
            case RtSeq(sender=s, n=n):
                self.seen.setdefault(s, []).append(n)
            case RtGetSeen():
                return {str(k): v for k, v in self.seen.items()}
            case RtForward(value=v, reply_to=ref):
                ref.tell(RtEcho(v))
                return ref.path
            case RtFail(text=t):
                raise ValueError(t)   # by ask: the asker gets it; by tell: a supervised failure
            case RtSleep(seconds=s):
                await asyncio.sleep(s)
                return "slept"
            case RtPlain():
                return {"ok": [1, 2, 3]}
            case RtStop():
                self.context.stop()


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--secret", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="node")
    p.add_argument("--redis-prefix", default=None)
    p.add_argument("--ttl", type=float, default=1.0)
    args = p.parse_args(argv)
    configure_logging("WARNING", json=True)
    registry = None
    if args.redis_prefix:
        from runtime.redis_registry import RedisRegistry
        registry = RedisRegistry("redis://127.0.0.1:6379/0", secret=args.secret, prefix=args.redis_prefix,
                                 ttl_s=args.ttl)
    system = ActorSystem(args.name, listen=("127.0.0.1", args.port), secret=args.secret,
                         registry=registry,
                         supervision=Supervision(max_restarts=2, backoff_initial_s=0.01))
    await system.start()
    system.install_signal_handlers()
    ref = await system.spawn(EchoActor(), name="echo")
    await system.spawn(EchoActor(), name="victim")   # for tests that stop an actor
    if registry is not None:
        await system.publish(f"{args.name}/echo", ref)
    print("READY", system.address, flush=True)
    return await system.terminated


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:])))
