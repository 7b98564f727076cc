"""Prompt logprobs in the OpenAI HTTP API's answers, in vLLM's shapes: the `prompt_logprobs`
list (None for the first prompt token, then per token a map of token id (a string) to
{logprob, rank, decoded_token}: the prompt's own token and the N most likely), and for
completions with `echo` and `logprobs`, the prompt's tokens before the generated ones in the
choice's `logprobs` (the first prompt token's logprob null). Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve_proto import inference_pb2


@dataclass(frozen=True)
class PromptScores:
    """One answer's prompt logprobs (`GenerateResponse.prompt_logprobs`, with the prompt's
    token ids the router put in) and how the request wants them shown."""

    msg: inference_pb2.PromptLogprobs
    decode: Callable[[int], str]  # a token's text, as logprobs show it
    echo: bool  # completions with echo and logprobs: the prompt's tokens lead each choice's logprobs

    @staticmethod
    def of(
        sp: inference_pb2.SamplingParams, echo: bool, chat: bool, chunks: Iterable[inference_pb2.GenerateResponse],
        decode: Callable[[int], str],
    ) -> PromptScores | None:
        """The scores carried by `chunks` (choice 0's first message has them), where asked."""
        if not sp.HasField("prompt_logprobs"):
            return None
        msg = next((c.prompt_logprobs for c in chunks if c.HasField("prompt_logprobs")), None)
        if msg is None:
            return None
        return PromptScores(msg, decode, echo and sp.logprobs and not chat)

    def listed(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: None, then one map per prompt token after the first."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for tok, lp, rank, top in zip(self.msg.token_ids[1:], self.msg.logprobs, self.msg.ranks, self.msg.top_logprobs):
            entry = {str(tok): {"logprob": lp, "rank": rank, "decoded_token": self.decode(tok)}}
            for j, (t, v) in enumerate(zip(top.token_ids, top.logprobs)):
                entry.setdefault(str(t), {"logprob": v, "rank": j + 1, "decoded_token": self.decode(t)})
            out.append(entry)
        return out

    def echoed(self, generated: dict[str, Any] | None, shift: int = 0) -> dict[str, Any] | None:
        """A completions choice's `logprobs` with the prompt's tokens first (`echo`): their
        logprobs (null for the first), top maps (null for the first) and offsets from 0; the
        generated tokens' offsets move on by `shift` (the echoed text before them)."""
        if not self.echo or generated is None:
            return generated
        texts = [self.decode(t) for t in self.msg.token_ids]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        tops: list[dict[str, float] | None] = [None]
        for tok, lp, top in zip(self.msg.token_ids[1:], self.msg.logprobs, self.msg.top_logprobs):
            entry = {self.decode(t): v for t, v in zip(top.token_ids, top.logprobs)}
            entry.setdefault(self.decode(tok), lp)
            tops.append(entry)
        return {
            "tokens": texts + generated["tokens"],
            "token_logprobs": [None, *self.msg.logprobs, *generated["token_logprobs"]],
            "top_logprobs": tops + generated["top_logprobs"],
            "text_offset": offsets + [o + shift for o in generated["text_offset"]],
        }

    def into_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A whole answer with `prompt_logprobs` at its top (and, for completions, in each
        choice, where vLLM puts it too)."""
        listed = self.listed()
        if answer.get("object") == "text_completion":
            for choice in answer["choices"]:
                choice["prompt_logprobs"] = listed
        answer["prompt_logprobs"] = listed
        return answer

    def into_event(self, event: str) -> str:
        """A stream event's JSON (an object) with `prompt_logprobs` added at its top."""
        return event[:-1] + ',"prompt_logprobs":' + json.dumps(self.listed(), separators=(",", ":")) + "}"


def echoed_choices(scores: PromptScores | None, choices: Sequence[Any], shift: int) -> list[Any]:
    """`choices` (frozen, with a `logprobs` field) with the prompt's tokens leading their logprobs
    where the request echoes with logprobs."""
    if scores is None or not scores.echo:
        return list(choices)
    return [replace(c, logprobs=scores.echoed(c.logprobs, shift)) for c in choices]


class FirstEventScores:
    """A stream's event maker (`StreamEvents`) whose first event carries `prompt_logprobs` at
    its top: choice 0's first message, the one that brought them."""

    def __init__(self, events: Any, scores: PromptScores | None) -> None:
        self._events = events
        self._scores = scores

    def chunk(self, *args: Any, **kwargs: Any) -> str:
        """The event's JSON, as the wrapped maker writes it (the first with the scores added)."""
        event = self._events.chunk(*args, **kwargs)
        if self._scores is not None:
            event, self._scores = self._scores.into_event(event), None
        return event
