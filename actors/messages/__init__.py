"""Every message that crosses an actor boundary, a module per boundary:

- `front_end`: a front end (the gateway, the offline LLM) and an engine: requests, token deltas, stats,
  LoRA adapters, an engine node's description. Crosses processes in a cluster.
- `step`: the scheduler and the model worker: a step's plan and its result.
- `kv`: the scheduler and the KV manager: a step's block transaction, reservations, the tier, stats, events.
- `handoff`: engine and engine, through their KV transfer actors: a request's KV handed from a prefill
  engine to a decode engine, and a cached prefix pulled from a peer. Crosses processes.

msgspec Structs only; array-like structs are positional on the wire, so new fields go at the end with
defaults. No logic beyond validating SamplingParams. Import each from its module; this package imports
nothing.
"""
