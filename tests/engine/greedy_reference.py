"""The reference every engine test compares against: transformers' greedy `generate`, and
prompts of mixed lengths to batch together."""

from __future__ import annotations

import random

import torch

from pdserve import LLM, SamplingParams

MAX_NEW = 24


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt):].tolist()


def mixed_prompts(vocab: int, seed: int, lengths=(1, 7, 16, 33, 50, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_same(llm: LLM, hf_model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf_model, p, max_new)
        assert o.token_ids == ref, f"prompt {i} (len {len(p)}): first divergence at {_first_diff(o.token_ids, ref)}"
        assert o.finish_reason == "length"
    return outs


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def step_with_arrivals(engine, prompts: list[list[int]], params: list[SamplingParams], after_step=None) -> dict[str, list[int]]:
    """Step `engine` until every request is done, adding request i (id "i") every other step, so
    requests arrive while others decode. Returns each request's tokens; `after_step(got)` runs
    after every step."""
    got: dict[str, list[int]] = {}
    pending, steps = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(p, params[i], str(i))
        for out in engine.step():
            got[out.request_id] = out.token_ids
        steps += 1
        if after_step is not None:
            after_step(got)
    return got


def record_steps(engine) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of every step `engine` launches blind or executes, from now
    on: its runner's two entry points are wrapped to count each step as it starts."""
    steps: list[tuple[int, int]] = []

    def record(launch, blind):
        def run(scheduled, *rest, **options):
            ahead = options.get("ahead", rest[0] if blind and rest else 0)
            ahead = ahead if isinstance(ahead, list) else [ahead] * len(scheduled)
            decodes = prompt = 0
            for item, m in zip(scheduled, ahead):
                if item.seq.num_computed_tokens + m >= item.seq.num_prompt_tokens:
                    decodes += 1
                else:
                    prompt += item.num_new_tokens
            steps.append((decodes, prompt))
            return launch(scheduled, *rest, **options)
        return run

    engine.runner.launch = record(engine.runner.launch, True)
    engine.runner.execute = record(engine.runner.execute, False)
    return steps
