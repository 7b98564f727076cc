"""The OpenAI-compatible HTTP API of a real local cluster (Ray, 1 prefill + 1 decode, KV over
NIXL), spoken to by the official `openai` client and by raw HTTP for the wire format."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from pdserve import SamplingParams

pytestmark = pytest.mark.cluster

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


def post(cluster, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(cluster.cfg.host, cluster.http_port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def test_openai_client_streams_a_chat_completion_equal_to_offline_generate(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    expected = offline.generate([offline.chat_prompt(messages)], SamplingParams(max_tokens=24, temperature=0.0))[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_openai_client_completion_without_streaming_equals_offline_generate(client, offline):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    expected = offline.generate(["The sky is"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(offline.tokenizer.encode("The sky is"))


def test_stop_string_and_seeded_sampling(client):
    kw = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    word = full.split()[2]  # a stop string the greedy answer is known to reach
    out = client.completions.create(**kw, stop=[word])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(word)]
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_sse_framing_ends_with_done(cluster):
    resp = post(cluster, "/v1/completions", {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "stream": True})
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ],
)
def test_bad_requests_get_the_openai_error_body(cluster, path, body, status, param):
    resp = post(cluster, path, body)
    assert resp.status == status
    err = json.loads(resp.read())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_models_and_health(client, cluster):
    assert [m.id for m in client.models.list().data] == [MODEL]
    conn = http.client.HTTPConnection(cluster.cfg.host, cluster.http_port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_client_disconnect_mid_stream_frees_blocks(cluster, channel, wait_until, blocks_free):
    body = {"prompt": list(range(100, 180)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(cluster.cfg.host, cluster.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        if resp.readline().startswith(b"data: "):
            events += 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_until(blocks_free(channel), 15, "every KV block to be freed after an HTTP client left")


def test_bench_serve_reports_latency_and_goodput(cluster, capsys):
    from pdserve.cli import main

    argv = ["bench", "serve", "--url", f"http://{cluster.http_address}", "--workload", "chat", "--scale", "0.1",
            "--requests", "4", "--concurrency", "2", "--max-output", "8", "--warmup", "1", "--quiet"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert (run["requests"], run["completed"]) == (4, 4)
    assert 4 <= run["output_tokens"] <= 32  # at most --max-output each, ignore_eos: at least one
    assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["itl_ms"]["p50"] > 0
    assert run["output_tok_s"] > 0 and 0 <= run["goodput_req_s"] <= run["req_s"]


def test_bench_serve_sweep_draws_the_curve(cluster, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from pdserve.cli import main

    png = tmp_path / "curve.png"
    argv = ["bench", "serve", "--url", f"http://{cluster.http_address}/v1", "--workload", "codegen", "--scale", "0.05",
            "--requests", "3", "--sweep", "4,8,16", "--max-output", "6", "--warmup", "0", "--quiet", "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rate"] for r in report["runs"]] == [4.0, 8.0, 16.0] and "knee_rate" in report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
