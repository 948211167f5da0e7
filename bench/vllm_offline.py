"""vLLM's offline `LLM.generate` on a bench.engine workload, run by vLLM's own interpreter.

`/tmp/vllmenv/bin/python bench/vllm_offline.py < job.json` reads the job (model folder, dtype, batch
limits, prompt token ids and max_tokens per request), loads the model, makes one small warm-up call
and then times one `generate` over every request, greedy with `ignore_eos`; it prints one line,
RESULT_PREFIX and a JSON object. Start-up, compilation and the warm-up are outside the timing.
It must import only the standard library and vllm: it runs in vLLM's venv, not Matinee's.
"""
import json
import sys
import time

RESULT_PREFIX = "bench.vllm_offline result: "


def run(job: dict) -> dict:
    """`job["loras"]` (optional): {name: PEFT folder}, and `job["lora_of"]` the name (or None) of each prompt's."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    loras = job.get("loras") or {}
    lora_args = {}
    if loras:
        lora_args = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=job.get("max_lora_rank", 16))
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              seed=0, **lora_args)
    startup_s = time.perf_counter() - t0

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(loras.items())}
    lora_of = [requests[n] if n else None for n in job.get("lora_of") or [None] * len(job["prompts"])]
    llm.generate([{"prompt_token_ids": job["prompts"][0][:8]}], greedy(2), use_tqdm=False, lora_request=lora_of[0])
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in job["max_tokens"]], use_tqdm=False,
                        lora_request=lora_of if loras else None)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "startup_s": startup_s,
            "dtype": job["dtype"]}


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(run(json.load(sys.stdin))), flush=True)
