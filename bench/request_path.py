"""What one streamed chat request passes through before its first token: hops, calls, the step's length.

Run from the repository root: python -m bench.request_path [--top 15]

A real gateway with its embedded engine (as `matinee serve` runs it) serves a tiny random-weight llama
on loopback. After a warm-up, one streamed POST /v1/chat/completions is watched by a profile function
on every server thread (not the client's), from the call of the route's handler to the return of the
SSE write that carries the first token. Counted in that window:

- calls: Python function calls whose code is in runtime/, actors/, gateway/, prefix_store/ or kernels/
  (a coroutine's call once, its resumptions apart); again with each model forward (ModelRunner.execute,
  execute_next) as one call, what runs inside it left out; and the distinct functions called.
- hops: each message put in an actor's mailbox (ActorCell.put: a tell, an ask, a pipe's outcome, a
  turn's re-entry) and each handoff to another thread (an executor's submit, as run_in_executor and
  to_thread do; call_soon_threadsafe from off the loop's thread). A put on an asyncio.Queue, from an
  actor to a request's handler, is listed too but not counted as a hop.

Also the length of the engine's step function, SchedulerActor.step, in source lines.
The server runs on the standard asyncio loop, not uvloop: a profiler does not see uvloop's methods
(the project's own calls are the same on both). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import dis
import inspect
import json
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import CodeType, FrameType

from runtime.cell import ActorCell, Signal
from runtime.ref import Ask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = tuple(os.path.join(ROOT, p) + os.sep for p in ("runtime", "actors", "gateway", "prefix_store", "kernels"))
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_PUT = ActorCell.put.__code__
_SUBMIT = ThreadPoolExecutor.submit.__code__
_THREADSAFE = asyncio.BaseEventLoop.call_soon_threadsafe.__code__
_QUEUE_PUT = asyncio.Queue.put_nowait.__code__


def step_lines() -> int:
    """SchedulerActor.step's length in source lines, from its `def` line, docstring and comments included."""
    from actors.scheduler.scheduler_actor import SchedulerActor
    return len(inspect.getsourcelines(SchedulerActor.step)[0])


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _item(item) -> str:
    """What a mailbox item carries: a message's type, an ask's, or a runtime signal's kind."""
    if isinstance(item, Ask):
        return f"ask {type(item.msg).__name__}"
    return f"signal {item.kind}" if isinstance(item, Signal) else type(item).__name__


class PathCounter:
    """A profile function for `threading.setprofile` / `sys.setprofile`. Once `arm()`ed, it counts from
    the next call of `start` until the return of the first call of `end` whose frame `end_if` accepts;
    calls of `forward` are counted as one (what runs inside them only in `calls`)."""

    def __init__(self, start: CodeType, end: CodeType, end_if: Callable[[FrameType], bool] = lambda f: True,
                 forward: tuple[CodeType, ...] = ()):
        self.start, self.end, self.end_if, self.forward = start, end, end_if, forward
        self.armed = self.counting = self.done = False
        # Appended by every thread (list.append holds the GIL): read once the window closes.
        self.calls: list[tuple[CodeType, bool]] = []   # each project call, and whether inside a forward
        self.resumes: list[CodeType] = []              # a project coroutine or generator resumed
        self.hops: list[tuple[str, str]] = []          # (kind, label) in the order they happened
        self._end_frame: FrameType | None = None
        self._in_forward: dict[int, FrameType] = {}    # thread -> the forward it is in
        self._entry: dict[CodeType, int] = {}

    def arm(self) -> None:
        self.armed = True

    def _fresh(self, frame: FrameType) -> bool:
        """A call, not a coroutine or generator resumed (that is a 'call' event too)."""
        code = frame.f_code
        if not code.co_flags & _RESUMABLE:
            return True
        entry = self._entry.get(code)
        if entry is None:   # where the body starts: the first RESUME (3.11+), 0 before
            entry = self._entry[code] = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
        return frame.f_lasti <= entry

    def __call__(self, frame: FrameType, event: str, arg) -> None:
        if event == "call":
            code = frame.f_code
            if not self.counting:
                if not (self.armed and code is self.start and self._fresh(frame)):
                    return
                self.armed, self.counting = False, True
            ours = code.co_filename.startswith(PROJECT)
            if not self._fresh(frame):
                if ours:
                    self.resumes.append(code)
                return
            ident = threading.get_ident()
            if ours:
                self.calls.append((code, ident in self._in_forward))
            if code in self.forward and ident not in self._in_forward:
                self._in_forward[ident] = frame
            if code is self.end and self._end_frame is None and self.end_if(frame):
                self._end_frame = frame
            if code is _PUT:
                cell, item = frame.f_locals["self"], frame.f_locals["item"]
                self.hops.append(("mailbox", f"{cell.path} <- {_item(item)}"))
            elif code is _SUBMIT:
                self.hops.append(("thread", f"{_name(frame.f_locals['self'])} <- {_name(frame.f_locals['fn'])}"))
            elif code is _THREADSAFE and frame.f_locals["self"]._thread_id != ident:
                self.hops.append(("thread", f"loop <- {_name(frame.f_locals['callback'])}"))
            elif code is _QUEUE_PUT:
                self.hops.append(("queue", f"asyncio.Queue <- {_name(frame.f_locals['item'])}"))
        elif event == "return" and self.counting:
            if frame is self._end_frame:
                self.counting, self.done = False, True
            elif self._in_forward.get(threading.get_ident()) is frame:
                del self._in_forward[threading.get_ident()]

    def summary(self, top: int = 0) -> dict:
        kinds = Counter(kind for kind, _ in self.hops)
        out = {
            "hops": kinds["mailbox"] + kinds["thread"],
            "hops_by_kind": {"mailbox": kinds["mailbox"], "thread": kinds["thread"]},
            "queue_puts": kinds["queue"],   # listed in the path, not counted as hops
            "calls": len(self.calls),
            "calls_outside_forward": sum(not inner for _, inner in self.calls),
            "distinct_functions": len({code for code, _ in self.calls}),
            "distinct_functions_outside_forward": len({code for code, inner in self.calls if not inner}),
            "calls_outside_forward_by_package": dict(Counter(
                os.path.relpath(code.co_filename, ROOT).split(os.sep)[0] for code, inner in self.calls if not inner)),
            "forwards": sum(code in self.forward for code, _ in self.calls),
            "coroutine_resumes": len(self.resumes),
            "path": [f"{kind}: {label}" for kind, label in self.hops],
        }
        if top:
            most = Counter(code for code, inner in self.calls if not inner).most_common(top)
            out["most_called_outside_forward"] = {
                f"{os.path.relpath(c.co_filename, ROOT)}:{c.co_firstlineno} {getattr(c, 'co_qualname', c.co_name)}": n
                for c, n in most}
        return out


def build_tiny_model(folder: str) -> str:
    """A 3-layer random-weight llama and a byte-level tokenizer (no merges) with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>", "<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[2],
                                   pad_token=specials[1], additional_special_tokens=specials[3:])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _first_token(frame: FrameType) -> bool:
    """An SSE write of token chunks: a choice's delta without the opening role."""
    return any("role" not in c.get("delta", {"role": None}) for e in frame.f_locals["events"]
               for c in e.get("choices", ()))


async def _chat(url: str) -> str:
    """One streamed chat request read to its end; the first token's text."""
    import aiohttp

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello, how are you?"}], "stream": True,
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = None
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            data = line.decode().strip().removeprefix("data: ")
            if data.startswith("{") and first is None:
                delta = json.loads(data)["choices"][0]["delta"]
                first = None if "role" in delta else delta.get("content")
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


def measure(top: int = 0) -> dict:
    from aiohttp import web

    from actors.config import EngineConfig
    from actors.worker.model_runner import ModelRunner
    from gateway.app import create_app, server_options
    from gateway.app_keys import STATE
    from gateway.config import GatewayConfig
    from gateway.embedded import embedded_launcher
    from gateway.handlers import chat_completions
    from gateway.sse import SSEWriter

    counter = PathCounter(chat_completions.__code__, SSEWriter.send.__code__, _first_token,
                          (ModelRunner.execute.__code__, ModelRunner.execute_next.__code__))
    loop = asyncio.SelectorEventLoop()   # the standard loop, whatever the policy: see the docstring
    with tempfile.TemporaryDirectory() as folder:
        engine = EngineConfig(model=build_tiny_model(folder), dtype="float32", num_blocks=64, max_num_seqs=8,
                              num_threads=1)
        app = create_app(GatewayConfig(served_model_name=["tiny"]), embedded_launcher(engine))
        runner = web.AppRunner(app, **server_options(GatewayConfig()))

        async def serve() -> str:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            await asyncio.wait_for(app[STATE].ready_event.wait(), 120)
            if app[STATE].startup_error:
                raise RuntimeError(app[STATE].startup_error)
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        threading.setprofile(counter)   # every thread started from here (not this one, the client's)
        server = threading.Thread(target=loop.run_forever, daemon=True)
        server.start()
        try:
            url = asyncio.run_coroutine_threadsafe(serve(), loop).result(180)
            asyncio.run(_chat(url))   # warm-up: the first request's one-time costs
            counter.arm()
            asyncio.run(_chat(url))
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
            server.join(10)
            threading.setprofile(None)
    if not counter.done:
        raise RuntimeError("the first token's write was never seen")
    return {**counter.summary(top), "step_lines": step_lines()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=0, help="also list the N most called functions outside the forward")
    args = ap.parse_args(argv)
    out = measure(args.top)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
