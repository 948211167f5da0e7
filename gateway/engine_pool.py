"""The gateway's view of a cluster: engines found in the registry, routed to by prefix and load,
and requests that lose their engine continued on another.

With prefill and decode engines (disaggregation) a request goes to a prefill engine chosen as a
colocated one would be, naming a decode engine chosen by load and free KV; the prefill engine
streams the first token and hands the KV over; a prompt of at most `local_prefill_tokens` runs
whole on the decode engine. A handoff that fails, or an engine of the pair
that dies before it, continues the request from its tokens so far, as a migration does.

Batch lines (ballast) are routed as any request, by prefix and by load (which counts every line
sent since the engine's last stats, so a wave of lines spreads over the engines), and a line goes
where this gateway just sent one sharing more of its prefix (gateway/prefix_affinity.py).

`EnginePool` is an `EngineConnection` as `EngineClient` is (gateway/engine_connection.py), so the
HTTP side does not care whether one embedded engine or many remote ones serve it.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.nodes.engine_node import REGISTRY_PREFIX
from actors.messages.front_end import (
    AbortRequest, EngineInfo, EngineStats, GetEngineInfo, GetStats, ListLoRAAdapters, LoadLoRAAdapter,
    LoRAAdapters, LoRAOutcome, SamplingParams, SubmitRefused, SubmitRequest, TokenDeltas, UnloadLoRAAdapter,
)
from actors.messages.handoff import HandoffDone, HandoffFailed
from gateway.engine_client import EngineLost, RequestFailed
from gateway.inflight import InflightRequest, Resubmission
from gateway.pool_metrics import PoolMetrics
from gateway.prefix_affinity import PrefixAffinity
from gateway.tenant import current_cache_salt
from prefix_store import EngineLoad, PrefixRouter, PromptHasher, TenantSalts, adapter_salt
from prefix_store.policy import RouteDecision
from runtime import Actor, ActorRef, ActorSystem, Terminated, get_logger

log = get_logger(component="engine-pool")

ROUTINGS = ("kv", "least_loaded", "round_robin")
JOIN_RETRY_S = 5.0


@dataclass
class PoolConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py).
    routing: str = field(default="kv", metadata={
        "help": "kv: where the prompt's prefix is cached (the prefix index), weighed against load; "
                "least_loaded: by load alone; round_robin: in turn",
        "choices": ROUTINGS})
    prefix_pull: bool = field(default=True, metadata={
        "help": "never have the chosen engine pull a prompt's prefix from another engine that holds more of it "
                "(in its pool or KV tier): compute it instead (by default, whatever the routing, it pulls when "
                "the pull is cheaper)", "flag": "no-prefix-pull"})
    max_migrations: int = field(default=3, metadata={   # past it the stream ends with an error
        "help": "how often one request may move to another engine"})
    # A short prompt's few tokens cost one decode step little, where on a prefill engine it would
    # queue behind long prompts and then wait for a handoff: it runs whole on the decode engine.
    local_prefill_tokens: int = field(default=64, metadata={
        "help": "with prefill and decode engines, a prompt of at most this many tokens is prefilled "
                "on its decode engine (no prefill queue, no handoff); 0: every prompt goes through a "
                "prefill engine"})
    discovery_interval_s: float = 0.5
    stats_interval_s: float = 0.25
    no_engine_wait_s: float = 10.0        # how long a request waits for some engine to appear
    join_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        for name in ("discovery_interval_s", "stats_interval_s", "no_engine_wait_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class _Engine:
    key: str                  # node/path: one run of one engine
    ref: ActorRef
    info: EngineInfo
    stats: EngineStats | None = None
    sent: int = 0             # requests sent since the ask of the last stats
    missing: int = 0          # discovery rounds in a row that did not list it
    draining: bool = False    # it refused a request: it will never admit again
    reserved: int = 0         # KV blocks of handoffs sent its way since the last stats (decode engines)
    full: bool = False        # it refused a handoff for want of room, since its last stats

    @property
    def routable(self) -> bool:
        # Two rounds, so a Redis that restarted empty (the entries come back with the next
        # beat) does not take every engine out of routing.
        return not self.draining and self.missing < 2

    def free_blocks(self) -> int | None:
        """Free KV blocks as far as the gateway knows; None before its first stats."""
        if self.full:
            return 0
        return None if self.stats is None else self.stats.kv_blocks_free - self.reserved

    def load(self) -> EngineLoad:
        s = self.stats
        if s is None:
            return EngineLoad(self.info.engine_id, requests_waiting=self.sent)
        return EngineLoad(self.info.engine_id, s.requests_running, s.requests_waiting + self.sent,
                          s.kv_blocks_total, s.kv_blocks_free)


class _Watch:
    def __init__(self, ref: ActorRef):
        self.ref = ref


class PoolReceiver(Actor):
    """Every engine's replies to this gateway, and their deaths, in arrival order."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    async def receive(self, msg: Any) -> None:
        match msg:
            case TokenDeltas(deltas=deltas):
                self.pool._on_deltas(deltas)
            case SubmitRefused(request_id=rid):
                self.pool._on_refused(rid)
            case HandoffDone(request_id=rid):
                self.pool._on_handed_over(rid)
            case HandoffFailed(request_id=rid, reason=reason, refused=refused):
                self.pool._on_handoff_failed(rid, reason, refused)
            case Terminated(ref=ref):
                self.pool._on_engine_dead(ref)
            case _Watch(ref=ref):
                self.context.watch(ref)


class EnginePool:
    def __init__(self, system: ActorSystem, registry: Any, router: PrefixRouter,
                 config: PoolConfig | None = None, salts: TenantSalts | None = None):
        self.system = system
        self.registry = registry
        self.router = router
        self.config = config or PoolConfig()
        self.salts = salts
        self.metrics = PoolMetrics(router.metrics, lambda: sum(e.routable for e in self.engines.values()))
        self.hasher: PromptHasher | None = None
        self.engines: dict[str, _Engine] = {}
        self._dead: set[str] = set()
        self._joining: set[str] = set()
        self._retry_at: dict[str, float] = {}   # registered but unreachable: try again later
        self._requests: dict[str, tuple[InflightRequest, asyncio.Queue]] = {}
        self._by_engine_rid: dict[str, str] = {}
        self._orphans: dict[str, str] = {}   # engine request id -> decode engine, of dropped handoffs
        self._tasks: set[asyncio.Task] = set()
        self._turn = itertools.count()
        self._affinity = PrefixAffinity()   # batch lines sharing a prefix, kept together
        self._changed = asyncio.Event()
        self.receiver: ActorRef | None = None

    async def start(self, name: str = "pool-receiver") -> None:
        self.receiver = await self.system.spawn(PoolReceiver(self), name=name)
        self._spawn(self._discover())
        self._spawn(self._poll_stats())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.router.store is not None:
            await self.router.store.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the EngineConnection interface -----------------------------------------------------
    @property
    def alive(self) -> bool:
        return any(e.routable for e in self.engines.values())

    @property
    def num_open(self) -> int:
        return len(self._requests)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue, priority: int = 0, request_salt: str | None = None,
               ballast: bool = False, lora_name: str | None = None) -> None:
        """As EngineClient.submit: the prompt's blocks salted for the tenant of the HTTP request
        being handled, and with the request's own `request_salt` (vLLM's cache_salt)."""
        cache_salt = current_cache_salt(self.salts, request_salt)
        req = InflightRequest(request_id, list(prompt_token_ids), params, priority, cache_salt, lora_name,
                              ballast=ballast)
        self._requests[request_id] = (req, queue)
        self._spawn(self._send(req, None))

    def abort(self, request_id: str, index: int | None = None) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        self._forget_handoffs(entry[0], lambda part: index is None or part.index in (None, index))
        for key, erid, i in entry[0].abort_targets(index):
            if i is None:
                self._by_engine_rid.pop(erid, None)
            e = self.engines.get(key)
            if e is not None:
                e.ref.tell(AbortRequest(erid, i))

    def release(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            for erid in entry[0].parts:
                self._by_engine_rid.pop(erid, None)

    async def engine_stats(self, timeout: float = 2.0) -> dict[str, EngineStats]:
        """Each routable engine's latest stats, by engine id, for the dashboard (never summed: each
        engine serves its own /metrics, and a sum across gateways would count it twice)."""
        return {e.info.engine_id: e.stats for e in self.engines.values() if e.stats is not None and e.routable}

    async def manage_lora(self, msg: LoadLoRAAdapter | UnloadLoRAAdapter | ListLoRAAdapters,
                          timeout: float = 600.0) -> LoRAOutcome | LoRAAdapters:
        """Every routable engine loads (or unloads) the adapter, so any of them can serve it; the first
        refusal is the answer. A list is the adapters every engine holds."""
        engines = [e for e in self.engines.values() if e.routable]
        replies = await asyncio.gather(*(e.ref.ask(msg, timeout=timeout) for e in engines))
        if isinstance(msg, ListLoRAAdapters):
            held = [r.adapters for r in replies]
            common = {n: p for n, p in held[0].items() if all(n in h for h in held)} if held else {}
            return LoRAAdapters(common, min((r.max_loras for r in replies), default=0))
        return next((r for r in replies if r.error), LoRAOutcome())

    async def wait_for_engine(self) -> EngineInfo:
        while not self.alive:
            self._changed.clear()
            await self._changed.wait()
        return next(e.info for e in self.engines.values() if e.routable)

    # ---- routing --------------------------------------------------------------------------
    async def _send(self, req: InflightRequest, resub: Resubmission | None) -> None:
        """Route and send in a task of the pool's; whatever fails on the way fails this request,
        so a request is always either sent or answered."""
        try:
            await self._route_and_send(req, resub)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("cannot send a request to an engine", request_id=req.request_id)
            self._fail(req, RequestFailed(f"The request could not be sent to an engine: {exc}"))

    async def _route_and_send(self, req: InflightRequest, resub: Resubmission | None) -> None:
        prompt = req.prompt_token_ids if resub is None else resub.prompt_token_ids
        params = req.params if resub is None else resub.params
        try:
            async with asyncio.timeout(self.config.no_engine_wait_s):
                while True:
                    engine, decode, pull_from = await self._choose(prompt, req.cache_salt, params,
                                                                   req.lora_name, req.ballast)
                    if engine is not None and engine.key in self.engines and engine.routable:
                        break
                    # No engine, or every decode engine is full: wait for the next change or stats.
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            self._fail(req, EngineLost("no engine is available to serve the request"))
            return
        if req.finished or req.request_id not in self._requests:
            return
        decode_key = decode.key if decode is not None else None
        if resub is None:
            erid = req.place(engine.key, decode_key)
        else:
            erid = resub.engine_request_id
            req.place_continuation(resub, engine.key, decode_key)
        self._by_engine_rid[erid] = req.request_id
        engine.sent += 1
        if engine.info.role == "decode":   # prefilled there: its KV takes room as a handoff's would
            engine.reserved += self._blocks_for(prompt)
        handoff_to = None
        if decode is not None:
            decode.sent += 1
            decode.reserved += self._blocks_for(prompt)
            handoff_to = decode.info.kv_receiver
        engine.ref.tell(SubmitRequest(erid, prompt, params, self.receiver, req.priority, req.cache_salt,
                                      handoff_to if req.lora_name is None else None,
                                      pull_from if handoff_to is None else None,
                                      ballast=req.ballast, lora_name=req.lora_name,
                                      lora_key=None if req.lora_name is None else _lora_key([engine], req.lora_name)))

    async def _choose(self, prompt: list[int], cache_salt: str | None, params: SamplingParams,
                      lora_name: str | None = None, ballast: bool = False
                      ) -> tuple[_Engine | None, _Engine | None, ActorRef | None]:
        """(the engine that runs the request, or prefills it; the decode engine it hands over to; the
        KV transfer actor of an engine it should pull the prompt's prefix from first).
        With prefill and decode engines of one KV layout up, requests are disaggregated (with n > 1
        or prompt logprobs they run whole on the prefill engine, with a short prompt whole on the
        decode engine); otherwise colocated engines serve them whole, or any engine left. A request
        with a LoRA adapter runs whole, on an engine that holds its adapter or has a slot free."""
        routable = [e for e in self.engines.values() if e.routable]
        if lora_name is not None:
            colocated = [e for e in routable if e.info.role == "engine"] or routable
            holders = _with_adapter(colocated, lora_name)
            engine, pull_from = await self._choose_among(holders, prompt,
                                                         adapter_salt(cache_salt, _lora_key(holders, lora_name)))
            return engine, None, pull_from
        prefill = [e for e in routable if e.info.role == "prefill"]
        # A handoff needs one KV layout (dtype, layers, heads) at both ends: `--dtype auto` can
        # resolve differently on two machines. A decode engine no prefill engine can feed is no target.
        layouts = {e.info.kv_layout for e in prefill}
        decode = [e for e in routable if e.info.role == "decode" and e.info.kv_receiver is not None
                  and e.info.kv_layout in layouts]
        if prefill and decode:
            whole = params.n > 1 or params.prompt_logprobs is not None
            target = None if whole else self._choose_decode(decode, prompt)
            if not whole and target is None:
                return None, None, None
            if target is not None and len(prompt) <= self.config.local_prefill_tokens:
                return target, None, None   # short: its decode engine prefills it
            if target is not None:
                prefill = [e for e in prefill if e.info.kv_layout == target.info.kv_layout]
            return (await self._choose_among(prefill, prompt, cache_salt, ballast))[0], target, None
        colocated = [e for e in routable if e.info.role == "engine"]
        engine, pull_from = await self._choose_among(colocated or routable, prompt, cache_salt, ballast)
        return engine, None, pull_from

    def _blocks_for(self, prompt: list[int]) -> int:
        return len(prompt) // self.hasher.block_size + 1 if self.hasher is not None else 1

    def _choose_decode(self, decode: list[_Engine], prompt: list[int]) -> _Engine | None:
        """The least loaded decode engine with room for the prompt's KV (before its first stats an
        engine counts as having room); None when every one is full."""
        need = self._blocks_for(prompt)
        free = {e.key: e.free_blocks() for e in decode}
        fits = [e for e in decode if free[e.key] is None or free[e.key] >= need]
        if not fits:
            return None
        return min(fits, key=lambda e: (e.load().requests_running + e.load().requests_waiting,
                                         -(free[e.key] or 0)))

    async def _choose_among(self, pool: list[_Engine], prompt: list[int], cache_salt: str | None,
                            ballast: bool = False) -> tuple[_Engine | None, ActorRef | None]:
        """The engine, and the KV transfer actor of another that holds more of the prompt's prefix
        (in its pool or KV tier, of the same KV layout) for it to pull from, if the policy says so and
        pulls are on.
        A batch line (`ballast`) goes where a line sharing more of its prefix was just sent."""
        if not pool:
            return None, None
        by_id = {e.info.engine_id: e for e in pool}   # the newest run of an id wins

        def loads() -> list[EngineLoad]:
            return [e.load() for e in by_id.values()]

        routing, hashes = self.config.routing, None
        if self.hasher is not None and (routing == "kv" or self.config.prefix_pull):
            hashes = self.hasher.block_hashes(prompt, cache_salt)
        if routing == "kv" and hashes is not None:
            decision = await self.router.route(hashes, loads)
            if ballast:
                decision = self._keep_together(decision, hashes, by_id)
        else:
            if routing == "round_robin":
                pool.sort(key=lambda e: e.info.engine_id)
                decision = RouteDecision(pool[next(self._turn) % len(pool)].info.engine_id, "round_robin", 0)
            else:
                decision = self.router.policy.choose(loads(), None, 0)
            self.router.metrics.record_decision("round_robin" if routing == "round_robin" else "load", 0, 0)
            if hashes is not None:   # chosen without the index: it only says whom to pull from
                matched = await self.router.lookup(hashes)
                decision = msgspec.structs.replace(decision, pull_from=self.router.policy.pull_source(
                    loads(), matched, len(hashes), decision.engine_id))
        engine, holder = by_id.get(decision.engine_id), by_id.get(decision.pull_from)
        if engine is None or holder is None or holder.info.kv_layout != engine.info.kv_layout \
                or not self.config.prefix_pull:
            return engine, None
        return engine, holder.info.kv_receiver

    def _keep_together(self, decision: RouteDecision, hashes: list[bytes], by_id: dict[str, _Engine]) -> RouteDecision:
        """The engine this gateway lately sent more of the prompt's blocks to than the index knows any
        engine to hold (they are being computed there), unless it is overloaded; else the decision."""
        engine_id, blocks = self._affinity.match(hashes)
        engine = by_id.get(engine_id)
        if engine is not None and blocks > decision.matched_blocks + decision.tier_blocks \
                and not self.router.policy.overloaded(engine.load()):
            decision = msgspec.structs.replace(decision, engine_id=engine_id, pull_from=None)
        self._affinity.remember(hashes, decision.engine_id)
        return decision

    def _fail(self, req: InflightRequest, error: Exception) -> None:
        entry = self._requests.get(req.request_id)
        if entry is not None:
            entry[1].put_nowait(error)

    def _forget_handoffs(self, req: InflightRequest, which) -> None:
        """Parts of `req` being handed over that `which` picks: their decode engine drops them now,
        or when it reports the handover (which may be on its way)."""
        for erid, part in req.parts.items():
            if part.decode is not None and which(part):
                self._orphans[erid] = part.decode
                self._tell_abort(part.decode, erid)

    def _tell_abort(self, key: str, engine_rid: str) -> None:
        e = self.engines.get(key)
        if e is not None:
            e.ref.tell(AbortRequest(engine_rid))

    # ---- replies and deaths (from the receiver actor) ---------------------------------------
    def _on_deltas(self, deltas) -> None:
        for d in deltas:
            rid = self._by_engine_rid.get(d.request_id)
            entry = self._requests.get(rid) if rid is not None else None
            if entry is None:
                continue
            out = entry[0].on_delta(d.request_id, d)
            if out is not None:
                entry[1].put_nowait(out)
            if d.request_id not in entry[0].parts:
                self._by_engine_rid.pop(d.request_id, None)

    def _on_refused(self, engine_rid: str) -> None:
        rid = self._by_engine_rid.pop(engine_rid, None)
        entry = self._requests.get(rid) if rid is not None else None
        if entry is None:
            return
        req = entry[0]
        part = req.parts.pop(engine_rid, None)
        if part is None:
            return
        e = self.engines.get(part.engine_id)
        if e is not None:
            e.draining = True   # send nothing more there
        if part.index is None:
            self._spawn(self._send(req, None))
        else:
            resub = req.continuation(part.index)
            if resub is not None:
                self._spawn(self._send(req, resub))

    def _on_handed_over(self, engine_rid: str) -> None:
        rid = self._by_engine_rid.get(engine_rid)
        entry = self._requests.get(rid) if rid is not None else None
        if entry is not None and entry[0].hand_over(engine_rid):
            self.metrics.handoffs += 1
            return
        key = self._orphans.pop(engine_rid, None)   # aborted, or continued elsewhere meanwhile
        if key is not None:
            self._tell_abort(key, engine_rid)

    def _on_handoff_failed(self, engine_rid: str, reason: str, refused: bool) -> None:
        """The KV never reached the decode engine: the request continues from its tokens so far,
        prefilled again (mostly from the prefix cache). A full decode engine is skipped until
        its next stats; a failure counts as a migration."""
        self._orphans.pop(engine_rid, None)
        rid = self._by_engine_rid.pop(engine_rid, None)
        entry = self._requests.get(rid) if rid is not None else None
        part = entry[0].parts.pop(engine_rid, None) if entry is not None else None
        if part is None:
            return
        req, queue = entry
        decode = self.engines.get(part.decode) if part.decode is not None else None
        log.warning("KV handoff failed", request_id=req.request_id, reason=reason, refused=refused)
        if refused:
            if decode is not None:
                decode.full = True
        else:
            self.metrics.handoff_failures += 1
            if req.migrations >= self.config.max_migrations:
                queue.put_nowait(EngineLost("the request's KV could not be handed over"))
                return
            req.migrations += 1
        index = part.index or 0
        resub = req.continuation(index)
        if resub is None:
            queue.put_nowait(req.finish_locally(index, "length"))
        else:
            self._spawn(self._send(req, resub))

    def _on_engine_dead(self, ref: ActorRef) -> None:
        key = f"{ref.node}/{ref.path}"
        engine = self.engines.pop(key, None)
        self._dead.add(key)
        if engine is None:
            return
        log.warning("engine lost", engine_id=engine.info.engine_id, address=ref.node)
        self._changed.set()
        for req, queue in list(self._requests.values()):
            if key not in req.engines():
                continue
            self._forget_handoffs(req, lambda part: key in (part.engine_id, part.decode))
            lost = req.lose_engine(key)
            if not lost:
                continue
            if req.migrations >= self.config.max_migrations:
                queue.put_nowait(EngineLost("the engine stopped and the request may not move again"))
                continue
            req.migrations += 1
            self.metrics.migrations += 1
            for index in lost:
                resub = req.continuation(index)
                if resub is None:
                    queue.put_nowait(req.finish_locally(index, "length"))
                else:
                    self._spawn(self._send(req, resub))

    # ---- discovery and load ---------------------------------------------------------------
    async def _discover(self) -> None:
        while True:
            try:
                entries = await self.registry.entries(REGISTRY_PREFIX)
            except Exception as exc:
                log.warning("engine discovery failed", error=repr(exc))
                entries = None
            if entries is not None:
                listed = {f"{node}/{path}": (node, path) for node, path in entries.values()}
                for key, e in self.engines.items():
                    was = e.routable
                    # Not listed: draining (it unregistered) or its beats stopped.
                    e.missing = 0 if key in listed else e.missing + 1
                    if e.routable != was:
                        self._changed.set()
                now = asyncio.get_running_loop().time()
                for key, (node, path) in listed.items():
                    if key in self._retry_at and now < self._retry_at[key]:
                        continue
                    if key not in self.engines and key not in self._dead and key not in self._joining:
                        self._joining.add(key)
                        self._spawn(self._join(key, node, path))
            await asyncio.sleep(self.config.discovery_interval_s)

    async def _join(self, key: str, node: str, path: str) -> None:
        try:
            ref = self.system.ref_for(node, path)
            info = await ref.ask(GetEngineInfo(), timeout=self.config.join_timeout_s)
        except Exception as exc:   # down, or it does not know the cluster secret
            log.warning("cannot reach a registered engine", address=node, error=repr(exc))
            self._retry_at[key] = asyncio.get_running_loop().time() + JOIN_RETRY_S
            return
        finally:
            self._joining.discard(key)
        self._retry_at.pop(key, None)
        if key in self._dead or info.draining:
            return
        if self.hasher is None:
            self.hasher = PromptHasher(info.block_size)
        self.engines[key] = _Engine(key, ref, info)
        self.receiver.tell(_Watch(ref))
        log.info("engine joined", engine_id=info.engine_id, address=node, role=info.role, kv_layout=info.kv_layout)
        partner = {"prefill": "decode", "decode": "prefill"}.get(info.role)
        others = {e.info.kv_layout for e in self.engines.values() if e.info.role == partner}
        if others and info.kv_layout not in others:
            log.warning("no engine of the other role shares this engine's KV layout: no handoffs with it",
                        engine_id=info.engine_id, role=info.role, kv_layout=info.kv_layout, theirs=sorted(others))
        self._changed.set()

    async def _poll_stats(self) -> None:
        while True:
            engines = list(self.engines.values())
            # A reply counts what was sent before its ask (one connection keeps their order), not what
            # was sent while it was on its way: those stay counted until the next one.
            asked = [(e.sent, e.reserved) for e in engines]
            results = await asyncio.gather(
                *(e.ref.ask(GetStats(), timeout=self.config.stats_interval_s * 4) for e in engines),
                return_exceptions=True)
            for e, (sent, reserved), r in zip(engines, asked, results):
                if isinstance(r, EngineStats):
                    e.stats, e.full = r, False
                    e.sent, e.reserved = max(e.sent - sent, 0), max(e.reserved - reserved, 0)
            self._changed.set()   # requests waiting for a decode engine with room look again
            await asyncio.sleep(self.config.stats_interval_s)


def _lora_key(engines: list[_Engine], lora_name: str) -> str:
    """Adapter `lora_name`'s identity in the engines' prefix-cache hashes (name@contents), as the first of
    `engines` that has it loaded last reported it; the name alone before any has (no prefix will match)."""
    for e in engines:
        if e.stats is not None and lora_name in e.stats.lora_keys:
            return e.stats.lora_keys[lora_name]
    return lora_name


def _with_adapter(engines: list[_Engine], lora_name: str) -> list[_Engine]:
    """Where a request for adapter `lora_name` may go, by the engines' latest stats: those running its
    requests (its slot is loaded there) while nothing waits on them; else those with a slot free (an
    engine without stats yet counts as free); else all of them. The router picks by prefix and load."""
    holding = [e for e in engines if e.stats is not None and lora_name in e.stats.lora_running
               and not e.stats.requests_waiting]
    if holding:
        return holding
    free = [e for e in engines if e.stats is None or len(e.stats.lora_running) < e.stats.max_loras]
    return free or engines
