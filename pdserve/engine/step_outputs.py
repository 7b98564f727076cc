"""What a step hands back: the tokens the scheduler accepted, each turned into a `RequestOutput`
(text through the request's detokenizer, stop strings, logprobs where asked). Called by the
engine after every step; finished requests leave its table here."""

from __future__ import annotations

from pdserve.engine.prompt_logprobs import PromptLogprob, prompt_logprobs_of
from pdserve.engine.request_table import RequestTable
from pdserve.engine.runner import SampledToken
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.sequence import SeqStatus


class RequestOutput:
    """One request's state after a step: every generated token so far, the text, and what
    this step added.

    `token_ids`, `logprobs` and `top_logprobs` hold everything so far as of this step. They are
    sliced from the sequence's lists (which only grow) when read, not copied at every step: a
    decode worker streams only `new_token_ids`, and copying every token so far for every row
    at every step made the host's work per step grow with the length of the answers."""

    __slots__ = (
        "_end",
        "_logprobs",
        "_num_logprobs",
        "_start",
        "_tokens",
        "_top_logprobs",
        "finish_reason",
        "finished",
        "new_text",
        "new_token_ids",
        "num_cached_tokens",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "text",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        text: str,
        finished: bool,
        finish_reason: str | None,
        tokens: list[int],
        num_output: int,
        *,
        num_cached_tokens: int = 0,
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
        new_token_ids: list[int] | None = None,
        new_text: str = "",
        prompt_logprobs: list[PromptLogprob | None] | None = None,
    ) -> None:
        """`tokens`: the prompt and the generated tokens (the sequence's list), of which the last
        `num_output` are generated; `logprobs` and `top_logprobs`: the sequence's lists, where
        asked for."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.text = text
        self.finished = finished
        self.finish_reason = finish_reason  # "stop", "length", "abort"; None while running or when only prefilled
        self.num_cached_tokens = num_cached_tokens
        self.new_token_ids = [] if new_token_ids is None else new_token_ids  # generated in this step
        self.new_text = new_text  # text that became final in this step
        # With params.prompt_logprobs, on the request's first output and its last: None for the
        # first prompt token, then each token's score (pdserve.engine.prompt_logprobs).
        self.prompt_logprobs = prompt_logprobs
        self._tokens, self._end = tokens, len(tokens)
        self._start = self._end - num_output
        self._logprobs, self._top_logprobs = logprobs, top_logprobs
        self._num_logprobs = 0 if logprobs is None else len(logprobs)

    @property
    def token_ids(self) -> list[int]:
        """Every generated token so far."""
        return self._tokens[self._start : self._end]

    @property
    def logprobs(self) -> list[float] | None:
        """The logprob of each generated token, where asked for."""
        return None if self._logprobs is None else self._logprobs[: self._num_logprobs]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """Per generated token: (token, logprob) of the most likely, best first, where asked for."""
        return None if self._top_logprobs is None else self._top_logprobs[: self._num_logprobs]

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, text={self.text!r}, "
            f"finished={self.finished}, finish_reason={self.finish_reason!r}, new_token_ids={self.new_token_ids!r})"
        )


def step_outputs(
    scheduler: Scheduler, requests: RequestTable, scheduled: list[ScheduledSeq], sampled: dict[str, SampledToken]
) -> list[RequestOutput]:
    """Hand the step's tokens to the scheduler and build the outputs of the requests that
    produced one; requests that finished are forgotten by `requests`."""
    tokens = {rid: s.token for rid, s in sampled.items()}
    produced = scheduler.update(scheduled, tokens)
    outputs: list[RequestOutput] = []
    detoks = requests.detok
    # Every row of every step comes through here: attribute reads are hoisted out of the loop.
    finished_, pinned = SeqStatus.FINISHED, SeqStatus.PINNED
    for seq in produced:
        rid = seq.request_id
        draw = sampled[rid]
        token = draw.token
        params = seq.params
        if params.logprobs and draw.logprob is not None:
            seq.logprobs.append(draw.logprob)
            if params.top_logprobs:
                seq.top_logprobs.append(draw.top_logprobs or [])
        detok = detoks[rid]
        matched = detok.add([token])
        if matched is not None and seq.status is pinned:
            # Prefill role: the KV stays pinned for its hand-over; the stop is the answer's end.
            seq.finish_reason = "stop"
        elif matched is not None and seq.status is not finished_:
            scheduler.finish(seq, "stop")
        status = seq.status
        finished = status is finished_ or status is pinned
        num_output = seq.num_output_tokens
        outputs.append(
            RequestOutput(
                rid,
                seq.prompt_token_ids,
                detok.text,
                finished,
                seq.finish_reason,
                seq.token_ids,
                num_output,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=seq.logprobs if params.logprobs else None,
                top_logprobs=seq.top_logprobs if params.top_logprobs else None,
                new_token_ids=[token],
                new_text=detok.stream_delta(finished),
                prompt_logprobs=prompt_logprobs_of(seq) if num_output == 1 or finished else None,
            )
        )
        if status is finished_:
            requests.forget(rid)
    return outputs
