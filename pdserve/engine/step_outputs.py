"""What a step hands back: the tokens the scheduler accepted, each turned into a `RequestOutput`
(text through the request's detokenizer, stop strings, logprobs where asked). Called by the
engine after every step; finished requests leave its table here."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.prompt_logprobs import PromptLogprob, prompt_logprobs_of
from pdserve.engine.request_table import RequestTable
from pdserve.engine.runner import SampledToken
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.sequence import SeqStatus


@dataclass
class RequestOutput:
    """One request's state after a step: every generated token so far, the text, and what
    this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"; None while running or when only prefilled
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None  # of each generated token, where asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token: (token, logprob), best first
    new_token_ids: list[int] = field(default_factory=list)  # generated in this step
    new_text: str = ""  # text that became final in this step
    # With params.prompt_logprobs, on the request's first output and its last: None for the
    # first prompt token, then each token's score (pdserve.engine.prompt_logprobs).
    prompt_logprobs: list[PromptLogprob | None] | None = None


def step_outputs(
    scheduler: Scheduler, requests: RequestTable, scheduled: list[ScheduledSeq], sampled: dict[str, SampledToken]
) -> list[RequestOutput]:
    """Hand the step's tokens to the scheduler and build the outputs of the requests that
    produced one; requests that finished are forgotten by `requests`."""
    tokens = {rid: s.token for rid, s in sampled.items()}
    produced = scheduler.update(scheduled, tokens)
    outputs: list[RequestOutput] = []
    for seq in produced:
        rid = seq.request_id
        draw = sampled[rid]
        token = draw.token
        if seq.params.logprobs and draw.logprob is not None:
            seq.logprobs.append(draw.logprob)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(draw.top_logprobs or [])
        detok = requests.detok[rid]
        matched = detok.add([token])
        if matched is not None and seq.status is SeqStatus.PINNED:
            # Prefill role: the KV stays pinned for its hand-over; the stop is the answer's end.
            seq.finish_reason = "stop"
        elif matched is not None and seq.status is not SeqStatus.FINISHED:
            scheduler.finish(seq, "stop")
        finished = seq.status in (SeqStatus.FINISHED, SeqStatus.PINNED)
        outputs.append(
            RequestOutput(
                request_id=rid,
                prompt_token_ids=seq.prompt_token_ids,
                token_ids=seq.output_token_ids,
                text=detok.text,
                finished=finished,
                finish_reason=seq.finish_reason,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=list(seq.logprobs) if seq.params.logprobs else None,
                top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
                new_token_ids=[token],
                new_text=detok.stream_delta(finished),
                prompt_logprobs=prompt_logprobs_of(seq) if seq.num_output_tokens == 1 or finished else None,
            )
        )
        if seq.status is SeqStatus.FINISHED:
            requests.forget(rid)
    return outputs
