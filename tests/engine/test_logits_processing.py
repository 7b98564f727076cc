"""Penalties, logit bias and min_tokens in the engine equal transformers' `generate` with its own
logits processors (repetition penalty, sequence bias, min new tokens) and a plain torch
reference for the frequency and presence penalties, token for token, greedy, in float32, with
rows of different settings batched together."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve import LLM, SamplingParams
from tests.engine.greedy_reference import mixed_prompts


class FrequencyPresence(LogitsProcessor):
    """OpenAI's penalties, plainly: counts of each token in the output so far."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(model, prompt: list[int], max_new: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    extra = kwargs.pop("extra", None)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList([extra] if extra else []), **kwargs,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


MAX_NEW = 20


def cases(prompt_len_of):
    """(engine params, transformers generate kwargs) per case."""
    return [
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3), {"repetition_penalty": 1.3}),
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=0.7), {"repetition_penalty": 0.7}),
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, frequency_penalty=1.5),
         {"extra": FrequencyPresence(prompt_len_of, 1.5, 0.0)}),
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, presence_penalty=1.5, frequency_penalty=-0.5),
         {"extra": FrequencyPresence(prompt_len_of, -0.5, 1.5)}),
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.4,
                        presence_penalty=0.3),
         {"repetition_penalty": 1.2, "extra": FrequencyPresence(prompt_len_of, 0.4, 0.3)}),
        (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={5: 3.0, 9: -2.0}),
         {"sequence_bias": {(5,): 3.0, (9,): -2.0}}),
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_processing_matches_transformers_batched(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf = tiny_model_factory(arch)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    check_blocks_freed(llm.engine)
    prompts = mixed_prompts(hf.config.vocab_size, seed=21, lengths=(5, 12, 30))
    requests = []
    for p in prompts:
        for params, kw in cases(len(p)):
            requests.append((p, params, kw))
    # Plain greedy rows in the same batch: processing touches only the rows that ask for it.
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    requests += [(p, plain, {}) for p in prompts]
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests])
    for i, ((prompt, params, kw), out) in enumerate(zip(requests, outs)):
        ref = hf_generate(hf, prompt, MAX_NEW, **dict(kw))
        assert out.token_ids == ref, f"case {i}: {params}"
    # The penalties do change the tokens here (else the comparison above would prove little).
    by_params = {}
    for (prompt, params, _), out in zip(requests, outs):
        by_params.setdefault(params, []).append(out.token_ids)
    same = [k for k, v in by_params.items() if k is not plain and v == by_params[plain]]
    assert not same, same


def test_min_tokens_holds_back_stops_then_lets_them_through(tiny_model_factory):
    model_dir, hf = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = mixed_prompts(hf.config.vocab_size, seed=3, lengths=(9,))[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0].token_ids
    stop = free[2]  # the greedy run emits this token third: as a stop token it ends the run there
    short = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]))[0]
    assert len(short.token_ids) <= 3 and short.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop], min_tokens=8))[0]
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:7]
    assert held.token_ids == hf_generate(hf, prompt, 30, min_new_tokens=8, eos_token_id=stop)


def test_logit_bias_forces_a_token_even_when_sampling(tiny_model_factory):
    model_dir, hf = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = mixed_prompts(hf.config.vocab_size, seed=4, lengths=(11,))[0]
    for params in (SamplingParams(max_tokens=12, temperature=0.0, logit_bias={13: 100}),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=3, logit_bias={13: 100})):
        assert llm.generate([prompt], params)[0].token_ids == [13] * 12


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_model_factory):
    model_dir, hf = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    prompts = mixed_prompts(hf.config.vocab_size, seed=6, lengths=(4, 9, 17))
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=11, presence_penalty=0.5)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.3, top_p=0.5), SamplingParams(max_tokens=16, temperature=0.0)]
    batch = llm.generate(prompts, [seeded, *others])
    assert batch[0].token_ids == alone
    # Resumed after 5 tokens as a decode worker resumes it: the rest is the same.
    resumed = llm.generate([prompts[0] + alone[:5]], seeded.after(5))[0].token_ids
    assert resumed == alone[5:]


def test_logprobs_are_the_models_and_top_logprobs_best_first(tiny_model_factory):
    model_dir, hf = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = mixed_prompts(hf.config.vocab_size, seed=8, lengths=(10,))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3))[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - ref[i, tok].item()) < 1e-4
        top = out.top_logprobs[i]
        assert [t for t, _ in top] == ref[i].topk(3).indices.tolist()
        assert top[0][0] == tok  # greedy: the chosen token is the most likely
        assert all(abs(lp - ref[i, t].item()) < 1e-4 for t, lp in top)
