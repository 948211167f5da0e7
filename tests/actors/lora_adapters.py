"""PEFT adapters made in the tests: random, nonzero A and B (so the adapter changes the output),
saved with peft's own save_pretrained; and transformers + peft's greedy tokens under one."""
from __future__ import annotations

import torch

# name -> (rank, alpha, target modules, rsLoRA): all seven projections, attention alone, the MLP alone.
ADAPTERS = {
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "attn": (4, 8, ["q_proj", "v_proj", "o_proj"], True),
    "mlp": (16, 8, ["gate_proj", "up_proj", "down_proj", "k_proj"], False),
}


def make_adapter(base: str, folder: str, name: str, seed: int = 0) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rank, alpha, targets, rslora = ADAPTERS[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():
        for param_name, p in peft_model.named_parameters():
            if "lora_" in param_name:
                p.normal_(0.0, 0.15)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Greedy tokens of transformers (+ peft with `adapter`), prompt by prompt, in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 1
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=num_new, min_new_tokens=0)
                out.append(gen[0, len(p):].tolist())
        return out
    finally:
        torch.set_num_threads(threads)
