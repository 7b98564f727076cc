"""A request's prompt logprobs (`pdserve.engine.prompt_logprobs`) as the worker protocol carries
them: `PromptLogprobs`, one entry per prompt token after the first."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.prompt_logprobs import PromptLogprob
from pdserve_proto import inference_pb2


def prompt_logprobs_msg(entries: Sequence[PromptLogprob | None]) -> inference_pb2.PromptLogprobs:
    """The message for an output's `prompt_logprobs` (None first: the first prompt token has
    no score and no entry)."""
    scored = [e for e in entries if e is not None]
    return inference_pb2.PromptLogprobs(
        logprobs=[e.logprob for e in scored],
        ranks=[e.rank for e in scored],
        top_logprobs=[inference_pb2.TopLogprobs(token_ids=[t for t, _ in e.top], logprobs=[lp for _, lp in e.top])
                      for e in scored],
    )
