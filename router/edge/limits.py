"""Limits on what one request may ask for, checked at the edge before any tokenizing or
placement: the size of its prompt and the number and length of its stop strings. The body size
is enforced by the servers themselves (gRPC's maximum message, aiohttp's client_max_size) from
`max_request_bytes`. `max_tokens` against the context is the router's own check (router/edge/parsing.py).

Each refusal is INVALID_ARGUMENT with a message that starts with the field, as the router's own
validation errors do (the HTTP server turns that into the OpenAI `param`)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2


@dataclass(frozen=True)
class InputLimits:
    """The most one request may carry: body bytes, prompt size, messages and stop strings (each >= 1)."""
    max_request_bytes: int = 4 * 2**20  # a request body or gRPC message
    max_prompt_chars: int = 1_000_000  # prompt text, or all messages' content together
    max_prompt_token_ids: int = 1_000_000  # prompt_token_ids (the context check comes later)
    max_messages: int = 4096
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # each stop string
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name}: {value}; must be >= 1")


def _refuse(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_request(request: inference_pb2.GenerateRequest, limits: InputLimits) -> None:
    """Raise RouterError(INVALID_ARGUMENT) naming the first field over its limit."""
    if len(request.prompt) > limits.max_prompt_chars:
        raise _refuse(f"prompt: {len(request.prompt)} characters; at most {limits.max_prompt_chars}")
    if len(request.prompt_token_ids) > limits.max_prompt_token_ids:
        n = len(request.prompt_token_ids)
        raise _refuse(f"prompt_token_ids: {n} tokens; at most {limits.max_prompt_token_ids}")
    if len(request.messages) > limits.max_messages:
        raise _refuse(f"messages: {len(request.messages)} messages; at most {limits.max_messages}")
    chars = sum(len(m.content) + len(m.role) for m in request.messages)
    if chars > limits.max_prompt_chars:
        raise _refuse(f"messages: {chars} characters in all; at most {limits.max_prompt_chars}")
    sp = request.sampling_params
    if len(sp.stop) > limits.max_stop_strings:
        raise _refuse(f"sampling_params.stop: {len(sp.stop)} stop strings; at most {limits.max_stop_strings}")
    for s in sp.stop:
        if len(s) > limits.max_stop_chars:
            raise _refuse(
                f"sampling_params.stop: a stop string of {len(s)} characters; at most {limits.max_stop_chars}"
            )
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise _refuse(
            f"sampling_params.stop_token_ids: {len(sp.stop_token_ids)} ids; at most {limits.max_stop_token_ids}"
        )
