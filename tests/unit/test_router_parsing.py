"""The router's request parsing: max_tokens against the context, and the chat default that fills it."""

from __future__ import annotations

import grpc
import pytest

from pdserve.router.edge.parsing import parse_request
from pdserve.router.handles import RouterError
from pdserve.router.router_config import RouterConfig
from pdserve_proto import inference_pb2

CONFIG = RouterConfig(model_id="m", max_model_len=64, vocab_size=100)


def _request(n_prompt: int, max_tokens: int | None = None) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(prompt_token_ids=list(range(1, n_prompt + 1)))
    if max_tokens is not None:
        req.sampling_params.max_tokens = max_tokens
    return req


def test_max_tokens_that_fit_the_context_are_kept():
    ids, params = parse_request(_request(10, 54), CONFIG, tokenizer=None)
    assert len(ids) == 10 and params.max_tokens == 54


def test_max_tokens_past_the_context_are_refused_naming_the_field():
    with pytest.raises(RouterError) as err:
        parse_request(_request(10, 55), CONFIG, tokenizer=None)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("sampling_params.max_tokens: 55 tokens")
    assert "at most 54" in err.value.message


def test_without_max_tokens_grpc_default_is_16_and_fill_context_takes_the_rest():
    assert parse_request(_request(10), CONFIG, tokenizer=None)[1].max_tokens == 16
    request = _request(10)
    assert parse_request(request, CONFIG, tokenizer=None, fill_context=True)[1].max_tokens == 54
    assert not request.sampling_params.HasField("max_tokens")  # the caller's message is left as it was
