"""A steady load for the controller policy's tests, shared by the policy and scaling tests."""

from __future__ import annotations

from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Signals

MODEL = load_perf_model("llama3-8b-h100")
PROMPT = 2000  # uncached tokens per request
OUTPUT = 500  # output tokens per request


def signals(now: float, p: int, d: int, prompt_req_s: float, decode_req_s: float, in_flight: bool = False) -> Signals:
    """A steady load: `prompt_req_s` requests/s of PROMPT tokens, `decode_req_s` of OUTPUT
    tokens; sequences decoding by Little's law at a 30 ms step. Demand is the arrivals', so it
    does not depend on the split (as the controller measures it)."""
    seqs = int(decode_req_s * OUTPUT * 0.03)
    return Signals(
        now=now,
        prefill_workers=p,
        decode_workers=d,
        arriving_prompt_tokens_s=prompt_req_s * PROMPT,
        arriving_requests_s=max(prompt_req_s, decode_req_s),
        arriving_output_tokens_s=decode_req_s * OUTPUT,
        queued_prefill_tokens=0.0,
        decode_seqs=seqs,
        decode_context_tokens=seqs * (PROMPT + OUTPUT / 2),
        decode_kv_use=0.5,
        change_in_flight=in_flight,
    )
