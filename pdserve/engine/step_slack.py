"""Prompt tokens a decoding step can carry and still end within a step-time target, from the
steps measured so far (pure: the engine feeds it each step's rows and seconds).

A step that decodes D rows and carries P prompt tokens is modelled as base(D) + P * per_token:
base is the decode-only step at that batch (smoothed per batch bucket, the buckets of the decode
CUDA graphs), per_token what a prompt token added to the mixed steps measured beside a known
base. The room of a step is what is left of the target after base, in prompt tokens. Until both
are measured a step gets PROBE_TOKENS, and never fewer than MIN_PROMPT_TOKENS, so a prompt placed
on a busy worker still moves.
"""

from __future__ import annotations

PROBE_TOKENS = 64
MIN_PROMPT_TOKENS = 16


def batch_bucket(decodes: int) -> int:
    """1, 2, 3-4, 5-8, then multiples of 16: the batch sizes decode CUDA graphs are captured for,
    whose steps cost about the same."""
    if decodes <= 8:
        return max(0, (decodes - 1).bit_length())
    return 3 + -(-decodes // 16)


class StepSlack:
    """The measured step costs of one engine and the prompt room they leave under `target_s`."""

    def __init__(self, target_s: float, smoothing: float = 0.2) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s: {target_s}; a step-time target must be positive")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: {smoothing}; must be in (0, 1]")
        self.target_s = target_s
        self._smoothing = smoothing
        self._decode_s: dict[int, float] = {}  # batch bucket -> decode-only step seconds
        self._token_s: float | None = None  # seconds a prompt token adds to a decoding step

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step that ran `decodes` decode rows and `prompt_tokens` prompt tokens in `seconds`
        (steps without decode rows say nothing about inter-token time and are ignored)."""
        if decodes <= 0 or seconds < 0:
            return
        bucket = batch_bucket(decodes)
        base = self._decode_s.get(bucket)
        if prompt_tokens == 0:
            self._decode_s[bucket] = seconds if base is None else base + self._smoothing * (seconds - base)
            return
        if base is None:
            return
        per = max(0.0, seconds - base) / prompt_tokens
        self._token_s = per if self._token_s is None else self._token_s + self._smoothing * (per - self._token_s)

    def decode_step_s(self, decodes: int) -> float | None:
        """The smoothed decode-only step at this batch; None before one was measured."""
        return self._decode_s.get(batch_bucket(decodes))

    def room(self, decodes: int) -> int:
        """Prompt tokens a step of `decodes` decode rows may carry to end within the target."""
        base = self._decode_s.get(batch_bucket(decodes))
        if base is None or self._token_s is None:
            return PROBE_TOKENS
        left = self.target_s - base
        if left <= 0:
            return MIN_PROMPT_TOKENS
        if self._token_s <= 0:
            return 1 << 30  # prompt tokens measured free: the step budget decides
        return max(MIN_PROMPT_TOKENS, int(left / self._token_s))
