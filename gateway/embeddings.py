"""POST /v1/embeddings: each input's prompt pooled as the model pools it, in OpenAI's shape.

Every input is a prompt of one Generation, batched by the scheduler with everything else; the
engine returns its pooled, normalised hidden state (actors/worker/pooling.py) with the prompt's
one forward. `encoding_format: base64` is the vector as little-endian float32, as OpenAI sends it.
"""
from __future__ import annotations

import base64

import msgspec
import numpy as np
from aiohttp import web

from actors.messages.front_end import SamplingParams
from gateway import handlers, protocol
from gateway.errors import internal, invalid
from gateway.generation import Generation
from gateway.params import priority_checked, truncated

_encode = msgspec.json.Encoder().encode


async def embeddings(request: web.Request) -> web.Response:
    return web.Response(body=_encode(await embed(await handlers.http_call(request))),
                        content_type="application/json")


async def embed(call: handlers.Call) -> dict:
    """The embeddings of a call's inputs, as the one JSON body the route answers."""
    state = call.state
    req, client, engine = await handlers.accept_body(state, call.body, protocol.EmbeddingRequest,
                                               protocol.validate_embedding)
    tok = engine.tokenizer
    given = protocol.completion_prompts(req.input, tok.vocab_size, param="input")
    prompts = [p if isinstance(p, list) else await handlers.off_loop(len(p), tok.encode, p) for p in given]
    prompts = [truncated(p, req.truncate_prompt_tokens, engine.max_model_len) for p in prompts]
    longest = max(len(p) for p in prompts)
    if longest >= engine.max_model_len:
        raise invalid(f"This model's maximum context length is {engine.max_model_len} tokens, but an input "
                      f"has {longest}; shorten it or set `truncate_prompt_tokens`.", param="input",
                      code="context_length_exceeded")
    priority_checked(req.priority, engine)
    state.check_capacity(len(prompts))
    rid, _ = handlers.request_ids(call.ids, req)
    params = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
    lora = state.check_model(req.model)   # an adapter's embeddings pool its own hidden states
    gen = Generation(client, tok, rid, prompts, params, [], req.priority or 0, state.metrics.of(call.ballast),
                     call.arrival, ballast=call.ballast, lora_name=lora)
    vectors: list[list[float] | None] = [None] * len(prompts)
    with handlers.running(state, gen):
        while not gen.done:
            for cd in await gen.next():
                if cd.embedding is not None:
                    vectors[cd.index] = cd.embedding
    if any(v is None for v in vectors):   # the engine finished a prompt without its pool
        raise internal("The engine returned no embedding for an input.")
    if req.dimensions is not None and req.dimensions != len(vectors[0]):
        raise invalid(f"This model embeds in {len(vectors[0])} dimensions and cannot shorten them; leave "
                      f"`dimensions` out or set it to {len(vectors[0])}.", param="dimensions")
    usage = gen.usage()
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": lora or state.model_name,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"]}}


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
