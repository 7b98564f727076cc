"""The sampling fields users expect, through a real `pdserve serve` (Ray, 1 prefill + 1 decode,
so the first token is sampled on the prefill worker and the rest on the decode worker), spoken
to by the official `openai` client and over gRPC, each checked against the offline engine with
the same settings: penalties, logit_bias, min_tokens, seeds."""

from __future__ import annotations

import grpc
import openai
import pytest

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
