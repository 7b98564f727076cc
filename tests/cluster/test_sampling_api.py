"""The sampling fields users expect, through a real `pdserve serve` (Ray, 1 prefill + 1 decode,
so the first token is sampled on the prefill worker and the rest on the decode worker), spoken
to by the official `openai` client and over gRPC, each checked against the offline engine with
the same settings: penalties, logit_bias, min_tokens, seeds, logprobs, prompt_logprobs (scored
on the prefill worker; echo with logprobs), and `n` choices of one prefill (seen in /metrics)."""

from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Count: one, two, three, four,"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


def offline_text(offline, prompt: str, **kw) -> tuple[str, list[int]]:
    out = offline.generate([prompt], SamplingParams(**kw))[0]
    return out.text, out.token_ids


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
        {"extra_body": {"repetition_penalty": 1.3}},
    ],
)
def test_penalties_change_the_tokens_as_offline(client, offline, fields):
    plain, _ = offline_text(offline, PROMPT, max_tokens=24, temperature=0.0)
    kw = {"temperature": 0.0, **fields}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **kw).choices[0].text
    engine_kw = {k: v for k, v in kw.items() if k != "extra_body"} | kw.get("extra_body", {})
    expected, _ = offline_text(offline, PROMPT, max_tokens=24, **engine_kw)
    assert out == expected
    assert expected != plain  # the penalty did something, or the check above would prove little


def test_logit_bias_forces_one_token_over_http_and_grpc(client, channel, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, logit_bias={"13": 100})
    text, ids = offline_text(offline, PROMPT, max_tokens=8, temperature=0.0, logit_bias={13: 100})
    assert ids == [13] * 8
    assert out.choices[0].text == text and out.usage.completion_tokens == 8
    sp = pb.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    sp.logit_bias[13] = 100.0
    got = [t for c in pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=120)
           for t in c.token_ids]  # fmt: skip
    assert got == [13] * 8


def test_min_tokens_holds_back_eos(client, offline):
    messages = [{"role": "user", "content": "Say hi."}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0.0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 50  # an answer that ends with EOS
    held = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n + 12, temperature=0.0, extra_body={"min_tokens": n + 8}
    )
    assert held.usage.completion_tokens >= n + 8
    text, _ = offline_text(offline, offline.chat_prompt(messages), max_tokens=n + 12, temperature=0.0, min_tokens=n + 8)
    assert held.choices[0].message.content == text


def test_sampling_fields_over_grpc_equal_offline(channel, offline):
    stub = pbg.InferenceStub(channel)
    kw = dict(max_tokens=20, temperature=0.7, seed=5, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.1,
              min_tokens=20)  # fmt: skip
    sp = pb.SamplingParams(**kw)
    sp.logit_bias[11] = -100.0
    got = [t for c in stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=120) for t in c.token_ids]
    # The proto's floats are float32: the offline engine gets the same values.
    engine_kw = {k: (sp.__getattribute__(k) if isinstance(v, float) else v) for k, v in kw.items()}
    _, ids = offline_text(offline, PROMPT, logit_bias={11: -100.0}, **engine_kw)
    assert got == ids and 11 not in got


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", float("nan")), ("frequency_penalty", 3.0), ("repetition_penalty", 0.0), ("min_tokens", 99)],
)
def test_bad_values_are_refused_over_grpc_naming_the_field(channel, field, value):
    with pytest.raises(grpc.RpcError) as info:
        list(pbg.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(**{field: value})), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


@pytest.mark.parametrize(
    "body",
    [{"presence_penalty": 2.5}, {"logit_bias": {"13": 101}}, {"logit_bias": {"x": 1}},
     {"logit_bias": {"999999": 1}}, {"min_tokens": 99, "max_tokens": 4}, {"repetition_penalty": -1}],
)
def test_bad_values_are_refused_over_http_naming_the_field(client, body):
    field = next(iter(body))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", **({"max_tokens": 4} | {"extra_body": body}))
    assert field in str(info.value)


def test_logprobs_over_http_equal_offline_and_the_chosen_token_is_the_argmax(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    expected = offline.generate([offline.chat_prompt(messages)],
                                SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3))[0]  # fmt: skip
    decode = lambda t: offline.tokenizer.decode([t])
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                             logprobs=True, top_logprobs=3, stream=stream)  # fmt: skip
        content = [e for c in out for e in (c.choices[0].logprobs.content or [])] if stream else out.choices[0].logprobs.content
        assert [e.token for e in content] == [decode(t) for t in expected.token_ids]
        for e, lp, top in zip(content, expected.logprobs, expected.top_logprobs):
            assert abs(e.logprob - lp) < 1e-4  # the first from the prefill worker, the rest from the decode worker
            assert [t.token for t in e.top_logprobs] == [decode(t) for t, _ in top]
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the argmax
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2)
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2))[0]
    lp = done.choices[0].logprobs
    assert lp.tokens == [decode(t) for t in expected.token_ids]
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, expected.logprobs, strict=True))
    assert [len(t) for t in lp.top_logprobs] == [2] * 6 and lp.text_offset[0] == 0


def test_logprobs_over_grpc_equal_offline(channel, offline):
    sp = pb.SamplingParams(max_tokens=6, temperature=0.9, seed=4, logprobs=True, top_logprobs=2, presence_penalty=0.5)
    chunks = list(pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=120))
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=sp.temperature, seed=4, logprobs=True,
                                                         top_logprobs=2, presence_penalty=0.5))[0]  # fmt: skip
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids  # seeded: the same draws across the split
    got = [lp for c in chunks for lp in c.logprobs]
    assert len(got) == 6 and all(abs(a - b) < 1e-4 for a, b in zip(got, expected.logprobs))
    tops = [list(t.token_ids) for c in chunks for t in c.top_logprobs]
    assert tops == [[t for t, _ in top] for top in expected.top_logprobs]


# A prompt no other test sends, so that no prefix cache holds it before the test that counts its prefills.
CHOICES_PROMPT = ("A list of the planets of the solar system, from the one nearest the sun outwards, with one fact "
                  "about each of them, written for a class of children:")
BLOCK = 16  # the engine's default KV block size


def _prefilled_tokens(cluster) -> float:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pdserve_prefilled_tokens_total")  # fmt: skip


def test_n_choices_prefill_the_prompt_once_and_each_equals_offline_greedy(client, cluster, channel, offline, wait_until,
                                                                          blocks_free):  # fmt: skip
    before = _prefilled_tokens(cluster)
    out = client.completions.create(model=MODEL, prompt=CHOICES_PROMPT, max_tokens=10, temperature=0.0, n=3)
    expected = offline.generate([CHOICES_PROMPT], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [expected.text] * 3
    assert [c.finish_reason for c in out.choices] == [expected.finish_reason] * 3
    n_prompt = len(offline.tokenizer.encode(CHOICES_PROMPT))
    assert out.usage.prompt_tokens == n_prompt and out.usage.completion_tokens == 3 * len(expected.token_ids)
    # One prefill: the prompt once, then each later choice only its tail past the last full block
    # (at least its last token), its full blocks taken from the decode worker's prefix cache.
    tail = n_prompt - BLOCK * ((n_prompt - 1) // BLOCK)
    assert _prefilled_tokens(cluster) - before == n_prompt + 2 * tail < 2 * n_prompt
    wait_until(blocks_free(channel), 15, "every KV block to be freed after n=3")


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_choices_each_equal_offline_with_seed_plus_index(client, offline, stream):
    messages = [{"role": "user", "content": "Tell me about a cat."}]
    kw = {"max_tokens": 12, "temperature": 1.0, "seed": 11}
    out = client.chat.completions.create(model=MODEL, messages=messages, n=3, logprobs=True, stream=stream,
                                         stream_options={"include_usage": True} if stream else None, **kw)  # fmt: skip
    texts, logprobs, reasons, usage = ["", "", ""], [[], [], []], [None] * 3, None
    for c in out if stream else [out]:
        usage = c.usage or usage
        for choice in c.choices:
            i = choice.index
            texts[i] += (choice.delta.content if stream else choice.message.content) or ""
            logprobs[i] += [e.logprob for e in (choice.logprobs.content or [])] if choice.logprobs else []
            reasons[i] = choice.finish_reason or reasons[i]
    prompt = offline.chat_prompt(messages)
    expected = [offline.generate([prompt], SamplingParams(**(kw | {"seed": 11 + i}), logprobs=True))[0] for i in range(3)]
    assert texts == [e.text for e in expected]
    assert reasons == [e.finish_reason for e in expected]
    for got, want in zip(logprobs, expected):
        assert len(got) == len(want.logprobs) and all(abs(a - b) < 1e-4 for a, b in zip(got, want.logprobs))
    assert len(set(texts)) > 1  # distinct streams, or the seeds would prove little
    assert usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_n_over_grpc_tags_each_choice_with_its_index(channel, offline, wait_until, blocks_free):
    sp = pb.SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2)
    chunks = list(pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=120))
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        expected = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=sp.temperature, seed=3 + i))[0]
        assert [t for c in mine for t in c.token_ids] == expected.token_ids
        assert [bool(c.finish_reason) for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].usage.completion_tokens == len(expected.token_ids)
    assert {c.index for c in chunks} == {0, 1} and len({c.request_id for c in chunks}) == 1
    wait_until(blocks_free(channel), 15, "every KV block to be freed after n=2")


def test_n_out_of_range_is_refused_naming_it(client, channel):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(grpc.RpcError) as err:
        list(pbg.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(n=0)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.n" in err.value.details()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_each_choice(client, offline, stream):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, n=2, echo=True, stream=stream)
    texts = ["", ""]
    for c in out if stream else [out]:
        for choice in c.choices:
            texts[choice.index] += choice.text
    expected, _ = offline_text(offline, PROMPT, max_tokens=6, temperature=0.0)
    assert texts == [PROMPT + expected] * 2
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0, echo=True)
    assert by_ids.choices[0].text == offline.tokenizer.decode(ids) + expected


def test_cancelling_n_choices_mid_stream_frees_every_block(channel, wait_until, blocks_free):
    sp = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=3)
    call = pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=120)
    seen = set()
    for c in call:
        seen.add(c.index)
        if len(seen) == 3:  # every choice is decoding
            break
    call.cancel()
    wait_until(blocks_free(channel), 15, "every KV block to be freed after cancelling n=3")


# ----- prompt_logprobs -----------------------------------------------------------------------------

# A prompt no other test sends, so no prefix cache holds it: the scores are the prefill worker's own.
SCORED_PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def _scored_offline(offline, prompt, n: int, **kw):
    return offline.generate([prompt], SamplingParams(temperature=0.0, prompt_logprobs=n, **kw))[0]


def _check_listed(listed, expected, decode, n: int) -> None:
    """vLLM's prompt_logprobs list against the offline engine's, to 1e-4."""
    assert listed[0] is None and len(listed) == len(expected)
    for got, want in zip(listed[1:], expected[1:]):
        keys = {int(k): v for k, v in got.items()}
        mine = [k for k, v in keys.items() if abs(v["logprob"] - want.logprob) < 1e-4 and v["rank"] == want.rank]
        assert mine, (got, want)
        for rank, (t, lp) in enumerate(want.top, 1):
            assert abs(keys[t]["logprob"] - lp) < 1e-4 and keys[t]["rank"] == rank
            assert keys[t]["decoded_token"] == decode(t)
        assert len(keys) <= n + 1


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_over_http_equal_offline(client, offline, stream):
    """Prefilled on the prefill worker, the prompt's scores come back with its first token."""
    decode = lambda t: offline.tokenizer.decode([t])
    ids = offline.tokenizer.encode(SCORED_PROMPT)
    expected = _scored_offline(offline, ids, 3, max_tokens=4)
    out = client.completions.create(model=MODEL, prompt=SCORED_PROMPT, max_tokens=4, temperature=0.0, stream=stream,
                                    extra_body={"prompt_logprobs": 3})  # fmt: skip
    events = list(out) if stream else [out]
    listed = events[0].model_extra["prompt_logprobs"]
    assert all("prompt_logprobs" not in e.model_extra for e in events[1:])
    _check_listed(listed, expected.prompt_logprobs, decode, 3)
    for i, tok in enumerate(ids[1:], 1):  # each entry holds the prompt's own token with its logprob
        assert abs(listed[i][str(tok)]["logprob"] - expected.prompt_logprobs[i].logprob) < 1e-4
    assert "".join(c.text for e in events for c in e.choices) == expected.text
    if not stream:
        assert out.choices[0].model_extra["prompt_logprobs"] == listed  # completions: in the choice too, as vLLM


# A prompt of its own, sent twice: the second time the prefill worker's prefix cache holds it.
TWICE_PROMPT = ("Scored twice: a prompt long enough to fill several blocks of the key-value cache, so that a "
                "prefix cache could serve most of it the second time it is sent.")


def test_a_cached_prompt_is_scored_again_with_the_same_prompt_logprobs(client, offline):
    """prompt_logprobs need every prompt position's logits: a prompt the prefill worker holds in
    its prefix cache is computed again, and its scores are those of the first time."""
    ids = offline.tokenizer.encode(TWICE_PROMPT)
    expected = _scored_offline(offline, ids, 2, max_tokens=3)
    first, again = (client.completions.create(model=MODEL, prompt=TWICE_PROMPT, max_tokens=3, temperature=0.0,
                                              extra_body={"prompt_logprobs": 2}) for _ in range(2))  # fmt: skip
    plain = client.completions.create(model=MODEL, prompt=TWICE_PROMPT, max_tokens=3, temperature=0.0)
    assert len(ids) > 2 * BLOCK and plain.usage.prompt_tokens_details.cached_tokens >= BLOCK  # it is cached
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # ... and was not taken from the cache
    assert again.model_extra["prompt_logprobs"] == first.model_extra["prompt_logprobs"]
    _check_listed(again.model_extra["prompt_logprobs"], expected.prompt_logprobs,
                  lambda t: offline.tokenizer.decode([t]), 2)  # fmt: skip
    assert again.choices[0].text == first.choices[0].text == expected.text


def test_prompt_logprobs_on_chat_equal_offline(client, offline):
    messages = [{"role": "user", "content": "Which is the largest ocean on Earth?"}]
    prompt = offline.chat_prompt(messages)
    expected = _scored_offline(offline, prompt, 0, max_tokens=3)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0,
                                         extra_body={"prompt_logprobs": 0})  # fmt: skip
    listed = out.model_extra["prompt_logprobs"]
    _check_listed(listed, expected.prompt_logprobs, lambda t: offline.tokenizer.decode([t]), 0)
    assert all(len(e) == 1 for e in listed[1:])  # N = 0: the prompt's own token only
    assert out.choices[0].message.content == expected.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_then_the_output(client, offline, stream):
    decode = lambda t: offline.tokenizer.decode([t])
    ids = offline.tokenizer.encode(SCORED_PROMPT)
    expected = offline.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2,
                                                      prompt_logprobs=2))[0]  # fmt: skip
    out = client.completions.create(model=MODEL, prompt=SCORED_PROMPT, max_tokens=5, temperature=0.0, echo=True,
                                    logprobs=2, stream=stream)  # fmt: skip
    choices = [c for e in out for c in e.choices] if stream else out.choices
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in choices:
        for k in lp:
            lp[k] += getattr(c.logprobs, k)
    assert "".join(c.text for c in choices) == SCORED_PROMPT + expected.text
    assert lp["tokens"] == [decode(t) for t in ids + expected.token_ids]
    want = [None] + [e.logprob for e in expected.prompt_logprobs[1:]] + expected.logprobs
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp["token_logprobs"][1:], want[1:], strict=True))
    for got, entry in zip(lp["top_logprobs"][1 : len(ids)], expected.prompt_logprobs[1:]):
        assert all(abs(got[decode(t)] - v) < 1e-4 for t, v in entry.top)
    assert lp["text_offset"][len(ids)] == len(SCORED_PROMPT)  # the output's text starts after the echoed prompt


def test_prompt_logprobs_over_grpc_equal_offline(channel, offline):
    ids = offline.tokenizer.encode(SCORED_PROMPT)
    sp = pb.SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    chunks = list(pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=SCORED_PROMPT, sampling_params=sp),
                                                      timeout=120))  # fmt: skip
    expected = _scored_offline(offline, ids, 2, max_tokens=3)
    scored = [c for c in chunks if c.HasField("prompt_logprobs")]
    assert len(scored) == 1 and scored[0] is chunks[0]
    pl = chunks[0].prompt_logprobs
    assert list(pl.token_ids) == ids and len(pl.logprobs) == len(ids) - 1
    for lp, rank, top, want in zip(pl.logprobs, pl.ranks, pl.top_logprobs, expected.prompt_logprobs[1:], strict=True):
        assert abs(lp - want.logprob) < 1e-4 and rank == want.rank
        assert list(top.token_ids) == [t for t, _ in want.top]
        assert all(abs(a - b) < 1e-4 for a, (_, b) in zip(top.logprobs, want.top))
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids


@pytest.mark.parametrize("bad", [-1, 21, "x"])
def test_bad_prompt_logprobs_are_refused_naming_the_field(client, channel, bad):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"prompt_logprobs": bad})
    assert info.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": bad})  # fmt: skip
    assert info.value.body["param"] == "prompt_logprobs"
    if bad == 21:  # the proto's field is unsigned: only a too-large count reaches the router
        with pytest.raises(grpc.RpcError) as err:
            list(pbg.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(prompt_logprobs=bad)), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.details()
