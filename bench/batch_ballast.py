"""Batch lines as ballast: does a batch slow interactive traffic, and how much of the spare
throughput does it use? `python -m bench.batch_ballast --url URL` against a running Matinee.

Three runs on the same server, one after the other: interactive chat at concurrency 32 alone (the
machine's throughput), at concurrency 8 alone, and at concurrency 8 again with a batch of
`--batch-lines` lines submitted as it starts. Reports interactive TTFT and inter-token p90 with
the batch over alone (target: within 1.10), and the batch's output tokens/s during the
interactive run over the spare throughput, c=32's minus c=8's (target: at least 0.5).
The batch is cancelled when the interactive run ends; what it finished by then is what counts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from bench.serving import _resolve_model, run_load, save_json
from bench.serving_data import make_requests


def batch_file(model: str, n: int, input_len: int, output_len: int, seed: int) -> bytes:
    reqs = make_requests("random", n, input_len=input_len, output_len=output_len, range_ratio=0.0, seed=seed)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": r.messages, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True}} for i, r in enumerate(reqs)]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def start_batch(session: aiohttp.ClientSession, base: str, data: bytes, headers: dict) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="ballast.jsonl", content_type="application/jsonl")
    async with session.post(f"{base}/v1/files", data=form, headers=headers) as r:
        r.raise_for_status()
        file_id = (await r.json())["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with session.post(f"{base}/v1/batches", json=body, headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["id"]


async def batch_counts(session: aiohttp.ClientSession, base: str, batch_id: str, headers: dict) -> dict:
    async with session.get(f"{base}/v1/batches/{batch_id}", headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["request_counts"]


async def amain(args: argparse.Namespace) -> dict:
    base = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await _resolve_model(base, headers)
    reqs = make_requests("random", args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                         seed=args.seed)

    async def interactive(concurrency: int) -> dict:
        return await run_load(base, model, reqs, rate=None, concurrency=concurrency, headers=headers,
                              ignore_eos=True, seed=args.seed, slo_ttft=2.0, slo_tpot=0.1)

    full = await interactive(32)
    alone = await interactive(8)
    async with aiohttp.ClientSession() as session:
        data = batch_file(model, args.batch_lines, args.input_len, args.output_len, args.seed + 1)
        batch_id = await start_batch(session, base, data, headers)
        start = time.perf_counter()
        mixed = await interactive(8)
        seconds = time.perf_counter() - start
        counts = await batch_counts(session, base, batch_id, headers)
        async with session.post(f"{base}/v1/batches/{batch_id}/cancel", headers=headers) as r:
            await r.read()
    spare = full["output_tok_s"] - alone["output_tok_s"]
    batch_tok_s = counts["completed"] * args.output_len / seconds
    return {
        "model": model, "interactive_c8_alone": alone, "interactive_c8_with_batch": mixed, "c32": full,
        "batch": {"lines": args.batch_lines, "completed_during_run": counts["completed"], "seconds": seconds,
                  "lines_s": counts["completed"] / seconds, "output_tok_s": batch_tok_s},
        "ttft_p90_ratio": mixed["ttft_s"]["p90"] / alone["ttft_s"]["p90"],
        "itl_p90_ratio": mixed["itl_s"]["p90"] / alone["itl_s"]["p90"],
        "spare_tok_s": spare, "spare_used": batch_tok_s / spare if spare > 0 else None,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.batch_ballast", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64, help="interactive requests per run")
    p.add_argument("--input-len", type=int, default=128, help="prompt words")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, interactive and batch")
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(amain(args))
    save_json(result, args.json)
    print(f"TTFT p90 with/alone {result['ttft_p90_ratio']:.2f}, ITL p90 {result['itl_p90_ratio']:.2f}; "
          f"batch {result['batch']['output_tok_s']:.1f} tok/s of {result['spare_tok_s']:.1f} spare "
          f"({result['spare_used'] or 0:.2f})", file=sys.stderr)
    if not args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
