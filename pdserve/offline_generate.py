"""`pdserve generate` without --address: the prompts through the offline engine in this process,
checked as the server checks them (max_tokens within the context), with progress on stderr for a
generation that runs long, and on Ctrl-C what was generated so far rather than nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from pdserve.engine.sampling_params import SamplingParams

PROGRESS_AFTER_S = 2.0  # a generation shorter than this prints no progress
PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class Generated:
    """One prompt's answer: its tokens and text so far, and why it ended (None: interrupted)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


def check_max_tokens(prompt_tokens: int, max_tokens: int, max_model_len: int, index: int, count: int) -> None:
    """ValueError naming --max-tokens when a prompt of `prompt_tokens` leaves less room in the
    context than `max_tokens` (the server refuses such a request the same way)."""
    room = max_model_len - prompt_tokens
    which = f" (prompt {index + 1} of {count})" if count > 1 else ""
    if room <= 0:
        raise ValueError(
            f"prompt: {prompt_tokens} tokens leave no room to generate in the context of {max_model_len}{which}"
        )
    if max_tokens > room:
        raise ValueError(
            f"--max-tokens: {max_tokens} tokens after a prompt of {prompt_tokens} exceed the context of "
            f"{max_model_len}; at most {room}{which}"
        )


class Progress:
    """Lines on `out` while a generation runs: tokens so far, prompts done, tokens/s; silent for
    the first `after_s` (a short generation prints nothing) and then one line every `every_s`."""

    def __init__(
        self, out: TextIO, total: int, after_s: float = PROGRESS_AFTER_S, every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._out = out
        self._total = total
        self._every_s = every_s
        self._clock = clock
        self._start = clock()
        self._next = self._start + after_s
        self.printed = 0

    def update(self, tokens: int, done: int) -> None:
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self._every_s
        rate = tokens / max(now - self._start, 1e-9)
        print(f"pdserve: generating: {tokens} tokens, {done} of {self._total} prompts done, {rate:.1f} tokens/s",
              file=self._out, flush=True)
        self.printed += 1


def generate(
    engine: Any, prompts: Sequence[str], params: SamplingParams, progress: Progress | None,
) -> tuple[list[Generated], bool]:
    """Run `prompts` through `engine` (an LLMEngine); ([answer per prompt], interrupted). On
    KeyboardInterrupt the unfinished requests are aborted and each answer holds what was generated
    up to then (finish_reason None)."""
    ids = []
    for i, prompt in enumerate(prompts):
        tokens = engine.tokenize(prompt)
        try:
            engine.validate(tokens, params)
        except ValueError as exc:
            raise ValueError(f"{exc} (prompt {i + 1} of {len(prompts)})" if len(prompts) > 1 else str(exc)) from None
        check_max_tokens(len(tokens), params.max_tokens, engine.max_model_len, i, len(prompts))
        ids.append(tokens)
    requests = [engine.add_request(t, params) for t in ids]
    latest: dict[str, Any] = {}
    interrupted = False
    try:
        while engine.has_unfinished():
            for out in engine.step():
                latest[out.request_id] = out
            if progress is not None:
                done = sum(1 for o in latest.values() if o.finished)
                progress.update(sum(len(o.token_ids) for o in latest.values()), done)
    except KeyboardInterrupt:
        interrupted = True
        for rid in requests:
            if rid not in latest or not latest[rid].finished:
                engine.abort(rid)
    finally:
        for rid in requests:
            engine.release(rid)
    answers = []
    for rid in requests:
        out = latest.get(rid)
        if out is None:
            answers.append(Generated([], "", None))
        else:
            answers.append(Generated(list(out.token_ids), out.text, out.finish_reason if out.finished else None))
    return answers, interrupted
