"""Every field an OpenAI request may carry, in one table: served, refused (and why), or ignored
as metadata. `check_fields` applies it before the body is parsed, so that no field is dropped
in silence: a field this server does not serve is a 400 naming it, unless its value asks for
nothing (`presence_penalty: 0`, `logprobs: false`). Serving a field is a one-line change here
plus its parsing in router/edge/openai_api.py; docs/operations.md lists the table (a test keeps
the two equal). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from types import MappingProxyType
from typing import Any


class Support(Enum):
    """What the server does with a field."""
    SERVED = "served"
    REFUSED = "refused"  # a 400 naming the field, unless the value is one of the field's neutral values
    IGNORED = "ignored"  # metadata OpenAI defines, accepted and not used


class Api(Enum):
    """The endpoint a field belongs to."""
    COMPLETIONS = "completions"
    CHAT = "chat"


BOTH = frozenset(Api)
CHAT = frozenset({Api.CHAT})
COMPLETIONS = frozenset({Api.COMPLETIONS})


@dataclass(frozen=True)
class Field:
    """One request field: what the server does with it, on which endpoints, why (for a refusal,
    the message's reason), and the values that ask for nothing and so pass even when refused."""
    support: Support
    apis: frozenset[Api]
    note: str
    neutral: tuple[Any, ...] = ()


def _served(apis: frozenset[Api], note: str) -> Field:
    return Field(Support.SERVED, apis, note)


def _refused(apis: frozenset[Api], note: str, *neutral: Any) -> Field:
    return Field(Support.REFUSED, apis, note, neutral)


def _ignored(apis: frozenset[Api], note: str) -> Field:
    return Field(Support.IGNORED, apis, note)


_SAMPLER = "not in the sampler yet"
_FUNCTIONS = "deprecated by OpenAI; use tools and tool_choice"

FIELDS: Mapping[str, Field] = MappingProxyType({
    # The request itself.
    "model": _served(BOTH, "must be the served model (404 otherwise)"),
    "prompt": _served(COMPLETIONS, "text, token ids, or a batch of one of those"),
    "messages": _served(CHAT, "text content (string or text parts); roles system, user, assistant (with "
                        "tool_calls), tool (with tool_call_id)"),
    "stream": _served(BOTH, "server-sent events"),
    "stream_options": _served(BOTH, "include_usage"),
    # Sampling.
    "max_tokens": _served(BOTH, "chat without it: up to the end of the context"),
    "max_completion_tokens": _served(CHAT, "as max_tokens"),
    "temperature": _served(BOTH, "0 (greedy) to 100"),
    "top_p": _served(BOTH, "(0, 1]"),
    "top_k": _served(BOTH, "vLLM's; -1 is off"),
    "seed": _served(BOTH, "below 2^64"),
    "stop": _served(BOTH, "a string or a list of strings"),
    "stop_token_ids": _served(BOTH, "vLLM's"),
    "ignore_eos": _served(BOTH, "vLLM's"),
    "n": _served(BOTH, "[1, 16]; one prefill; with seed, choice i draws as seed + i"),
    "presence_penalty": _served(BOTH, "[-2, 2]"),
    "frequency_penalty": _served(BOTH, "[-2, 2]"),
    "repetition_penalty": _served(BOTH, "vLLM's; (0, 100], 1 is off"),
    "logit_bias": _served(BOTH, "token id -> [-100, 100]"),
    "min_tokens": _served(BOTH, "vLLM's; holds back EOS and stop_token_ids"),
    "min_p": _refused(BOTH, _SAMPLER, 0),
    "best_of": _refused(COMPLETIONS, "no ranking of candidates (n is served)", 1),
    "use_beam_search": _refused(BOTH, "no beam search", False),
    "logprobs": _served(BOTH, "chat: a boolean; completions: N, the top N too, N in [0, 20]"),
    "top_logprobs": _served(CHAT, "[0, 20]; with logprobs: true"),
    "prompt_logprobs": _served(BOTH, "vLLM's; N in [0, 20]; the prompt's tokens scored, with the top N"),
    "echo": _served(COMPLETIONS, "the prompt's text before each choice's; with logprobs, its tokens' too"),
    "suffix": _refused(COMPLETIONS, "no insertion", ""),
    # Structured output, tools and other kinds of output.
    "response_format": _served(BOTH, "text, json_object, json_schema: the output is held to it by a grammar"),
    "guided_json": _served(BOTH, "vLLM's; a JSON schema (one structured-output field per request)"),
    "guided_regex": _served(BOTH, "vLLM's; a regular expression"),
    "guided_choice": _served(BOTH, "vLLM's; a list of strings"),
    "guided_grammar": _served(BOTH, "vLLM's; an EBNF grammar (xgrammar's dialect)"),
    "tools": _served(CHAT, "functions, rendered by the model's chat template (400 if it renders no tools); "
                     "strict held by a grammar, under auto too"),
    "tool_choice": _served(CHAT, "none; auto (with --enable-auto-tool-choice and --tool-call-parser); required "
                           "or a named function (held to a valid call by a grammar)"),
    "parallel_tool_calls": _served(CHAT, "false: at most one call"),
    "functions": _refused(CHAT, _FUNCTIONS, []),
    "function_call": _refused(CHAT, _FUNCTIONS, "none"),
    "audio": _refused(CHAT, "text only"),
    "modalities": _refused(CHAT, "text only", ["text"]),
    "prediction": _refused(CHAT, "no predicted outputs"),
    "web_search_options": _refused(CHAT, "no web search"),
    "reasoning_effort": _refused(CHAT, "not a reasoning model's server"),
    "verbosity": _refused(CHAT, "not a reasoning model's server"),
    "chat_template": _refused(CHAT, "the model's own template only"),
    "chat_template_kwargs": _refused(CHAT, "the model's own template only", {}),
    "add_generation_prompt": _refused(CHAT, "always on", True),
    "continue_final_message": _refused(CHAT, "not served", False),
    # Metadata OpenAI defines: accepted, not used.
    "user": _ignored(BOTH, "metadata"),
    "metadata": _ignored(CHAT, "metadata"),
    "store": _ignored(CHAT, "metadata; nothing is stored"),
    "service_tier": _ignored(CHAT, "metadata; one tier"),
    "safety_identifier": _ignored(CHAT, "metadata"),
    "prompt_cache_key": _ignored(CHAT, "metadata; the router's prefix cache needs no key"),
})


class FieldError(ValueError):
    """A field the request may not carry: `param` names it, `status` is the HTTP status."""

    def __init__(self, param: str, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.status = status


def check_fields(body: Mapping[str, Any], api: Api, allow_unknown: bool = False) -> None:
    """Refuse (FieldError) the first field of `body` this server would not honour: a refused
    field with a value that asks for something, or a field unknown on `api` (unless
    `allow_unknown`: vLLM's clients send extra fields of its own)."""
    for name, value in body.items():
        rule = FIELDS.get(name)
        if rule is None or api not in rule.apis:
            if allow_unknown:
                continue
            if rule is not None:
                other = "chat completions" if api is Api.COMPLETIONS else "completions"
                raise FieldError(name, f"a field of {other} only, not of this endpoint")
            raise FieldError(name, "unknown field (--allow-unknown-fields lets the server ignore such fields)")
        if rule.support is Support.REFUSED and value is not None and not _is_neutral(value, rule.neutral):
            raise FieldError(name, f"not supported by this server ({rule.note})")


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Is `value` one of `neutral`, JSON type and all (false is not 0, 0 is not false)?"""
    for n in neutral:
        if isinstance(n, bool) or isinstance(value, bool):
            if value is n:
                return True
        elif isinstance(n, (int, float)):
            if isinstance(value, (int, float)) and value == n:
                return True
        elif value == n:
            return True
    return False
