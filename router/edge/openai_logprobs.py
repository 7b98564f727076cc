"""Logprobs in the OpenAI HTTP API: the request fields in (chat's `logprobs: true` with
`top_logprobs: N`, completions' `logprobs: N`), and the `logprobs` object of a choice out, in
each API's own shape. Token strings are each token decoded alone, as vLLM writes them. Pure:
no I/O; `openai_api` calls these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS
from pdserve_proto import inference_pb2


class LogprobsFieldError(ValueError):
    """A logprobs field with a value this server cannot take: `param` names it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobsFieldError(name, f"must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise LogprobsFieldError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def parse_logprobs(body: dict[str, Any], chat: bool, sp: inference_pb2.SamplingParams) -> None:
    """Set `sp.logprobs`, `sp.top_logprobs` and `sp.prompt_logprobs` from `body`
    (LogprobsFieldError naming the field)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise LogprobsFieldError("logprobs", f"must be a boolean, got {type(value).__name__}")
        top = body.get("top_logprobs")
        if top is not None:
            sp.top_logprobs = _count("top_logprobs", top)
            if sp.top_logprobs and not value:
                raise LogprobsFieldError("top_logprobs", "needs logprobs: true")
        sp.logprobs = bool(value)
    elif value is not None:
        sp.top_logprobs = _count("logprobs", value)
        sp.logprobs = True
    prompt = body.get("prompt_logprobs")
    if prompt is not None:
        sp.prompt_logprobs = _count("prompt_logprobs", prompt)


def echo_logprobs(sp: inference_pb2.SamplingParams) -> None:
    """Completions' `echo` with `logprobs: N`: the prompt's tokens are scored too, with N most
    likely tokens each unless `prompt_logprobs` says how many (vLLM's rule)."""
    if sp.logprobs and not sp.HasField("prompt_logprobs"):
        sp.prompt_logprobs = sp.top_logprobs


def _entry(decode: Callable[[int], str], token: int, logprob: float) -> dict[str, Any]:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def choice_logprobs(
    chat: bool,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[inference_pb2.TopLogprobs],
    decode: Callable[[int], str],
    text_offset: int = 0,
) -> dict[str, Any]:
    """A choice's `logprobs` for these tokens. Chat: {"content": [{token, logprob, bytes,
    top_logprobs}]}. Completions: {tokens, token_logprobs, top_logprobs, text_offset}, where
    each top_logprobs entry maps token text to logprob and holds the chosen token too."""
    tops = [list(zip(t.token_ids, t.logprobs)) for t in top_logprobs] or [[] for _ in token_ids]
    tops += [[] for _ in range(len(token_ids) - len(tops))]
    if chat:
        content = []
        for tok, lp, top in zip(token_ids, logprobs, tops):
            entry = _entry(decode, tok, lp)
            entry["top_logprobs"] = [_entry(decode, t, v) for t, v in top]
            content.append(entry)
        return {"content": content, "refusal": None}
    texts = [decode(t) for t in token_ids]
    offsets = []
    at = text_offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    top_maps = []
    for tok, lp, top in zip(token_ids, logprobs, tops):
        entry = {decode(t): v for t, v in top}
        entry.setdefault(decode(tok), lp)
        top_maps.append(entry)
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_maps, "text_offset": offsets}
