"""The offline API on a tiny model: prompts as text or ids, seeds reproducible across batch mixes,
n > 1, stop strings and stop tokens, logprobs against transformers, stats and shutdown.
"""
from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from tests.actors.test_llm_parity import prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=160,
             max_num_batched_tokens=96) as llm:
        yield llm


def test_seeded_sampling_is_reproducible_across_batch_mixes(llm):
    target = prompts(11, (37,))[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    others = prompts(12, (3, 120, 250, 9))
    mix = [others[0], others[1], target, others[2], others[3]]
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True),
                    SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
                    sp, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=1.3, top_k=20, max_tokens=25, ignore_eos=True)]
    mixed = llm.generate(mix, mixed_params)[2].outputs[0].token_ids
    assert mixed == alone
    unseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True)
    draws = {tuple(llm.generate([target], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1 or tuple(alone) not in draws  # without a seed, draws differ


@pytest.mark.parametrize("prompt_len", [45, 5, 16, 17])
def test_n_samples_are_distinct_and_reproducible(llm, prompt_len):
    # 5 and 16 tokens: no full block below the last prompt token to share, so no fork.
    p = prompts(13, (prompt_len,))[0]
    sp = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=15, ignore_eos=True)
    first = llm.generate([p], sp)[0]
    again = llm.generate([p], sp)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert all(len(s) == 15 for s in samples) and len(set(samples)) == 3
    assert samples == [tuple(o.token_ids) for o in again.outputs]
    s = llm.stats()
    assert s.kv_blocks_free == s.kv_blocks_total


def test_text_prompts_stop_strings_and_stop_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = llm.generate("The quick brown fox", greedy)[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The quick brown fox")
    full = out.outputs[0]
    assert full.text == llm.get_tokenizer().decode(full.token_ids)
    # A stop string taken from the middle of the greedy text: the output ends right before it.
    visible = full.text
    start = next(i for i in range(4, len(visible) - 3) if visible[i:i + 3].strip())
    stop = visible[start:start + 3]
    cut = visible.index(stop)
    stopped = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                 stop=[stop]))[0].outputs[0]
    assert stopped.text == visible[:cut]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)
    # A stop token ends the sample on it (kept in token_ids, as transformers and vLLM do).
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    by_token = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                  stop_token_ids=[tok]))[0].outputs[0]
    assert by_token.token_ids == full.token_ids[:first + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == tok
    s = llm.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.requests_running == 0


def test_logprobs_match_transformers(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    p = prompts(14, (23,))[0]
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([p + comp.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(p) - 1:-1], dim=-1)
    for pos, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert tok in lp and len(lp) == 3  # the sampled (greedy: also the top) token and 2 more
        assert lp[tok] == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        top3 = ref[pos].topk(3)
        for t, v in zip(top3.indices.tolist(), top3.values.tolist()):
            assert lp[t] == pytest.approx(v, abs=1e-4)
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)))


def test_list_of_params_and_bad_input(llm):
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0.0, max_tokens=2),
                                              SamplingParams(temperature=0.0, max_tokens=4)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("use_tqdm", [True, False])
def test_use_tqdm_draws_a_bar_over_the_prompts(llm, capfd, use_tqdm):
    capfd.readouterr()
    llm.generate(prompts(3, (4, 7, 12)), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=use_tqdm)
    err = capfd.readouterr().err
    assert ("Processed prompts" in err and "3/3" in err) == use_tqdm
    assert err == "" or use_tqdm


def test_bad_engine_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kernels"):
        LLM(str(tmp_path), kernels="cuda-magic")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        LLM(str(tmp_path))  # one clear error from the constructor, no actor left running


def test_the_step_token_budget_defaults_by_device(tmp_path):
    from actors.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EngineConfig

    assert EngineConfig(str(tmp_path), device="cpu").step_tokens() == CPU_STEP_TOKENS
    assert EngineConfig(str(tmp_path), device="cuda").step_tokens() == GPU_STEP_TOKENS
    assert EngineConfig(str(tmp_path), device="cpu", max_num_batched_tokens=300).step_tokens() == 300
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        EngineConfig(str(tmp_path), max_num_batched_tokens=0)
