"""The draft role of a cluster (`matinee serve --role draft`): draft workers in their own node.

The node registers its DraftService under `drafts/<id>` in the runtime's Redis registry (TTL
heartbeat). Engines started with `speculative={"draft_node": id}` (`--speculative-draft-node`)
attach to it over TCP and each get a draft worker of their own there, so the draft model's
weights and compute live apart from the target's. SIGTERM stops it; its engines go on without
drafts and attach again when a node of that id is back.
"""

from __future__ import annotations

import asyncio
import contextlib

from actors.draft.config import SpeculativeConfig
from actors.draft.draft_link import DRAFT_NODE_PREFIX
from actors.draft.draft_service import DraftService
from actors.nodes.engine_node import EngineNodeConfig, start_node_system
from runtime import get_logger

log = get_logger(component="draft-node")


async def run_draft_node(node: EngineNodeConfig, spec: SpeculativeConfig, *, dtype: str = "float32",
                         kernels: str = "auto", device: str = "cpu", num_threads: int | None = None,
                         seed: int = 0, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop`). `node.engine_id` is the draft node's id."""
    service = DraftService(spec, dtype=dtype, kernels=kernels, device=device, num_threads=num_threads,
                           seed=seed)
    stop = stop or asyncio.Event()
    system = await start_node_system(node, f"draft-{node.engine_id}", stop)
    try:
        ref = await system.spawn(service, name="draft-service")
        name = DRAFT_NODE_PREFIX + node.engine_id
        await system.publish(name, ref)
        log.info("draft node serving", node_id=node.engine_id, method=spec.method, address=system.address)
        print(f"matinee draft node {node.engine_id} ({spec.method}) serving at {system.address}", flush=True)
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, system.terminated], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        with contextlib.suppress(Exception):
            await system.unpublish(name)
    finally:
        await system.shutdown()
    return system.exit_code or 0
