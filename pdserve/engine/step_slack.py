"""Prompt tokens a decoding step may carry while the steps' mean time stays within a target,
from measured steps (pure: the engine reports each step planned and each step's time).

Model: a step of D decode rows and P prompt tokens takes base(D) + P * per_token (base per batch
bucket of the decode graphs, from its decode-only steps, or from a mixed step once per_token is
known; per_token from mixed steps beside a known base). Decoding steps add
(target - time) to a credit (capped at CREDIT_STEPS targets); a step carries what its own slack
and the credit, less chunks planned but not yet timed, pay for. Over the target: no chunks but
MIN_PROMPT_TOKENS after STARVE_STEPS steps without one, so a prompt still moves. Costs unknown:
PROBE_TOKENS while the credit is not negative. docs/engine.md, "Scheduling".
"""

from __future__ import annotations

from collections import deque

PROBE_TOKENS = 64
MIN_PROMPT_TOKENS = 16
STARVE_STEPS = 8
CREDIT_STEPS = 2
OUTLIER = 4.0  # a decode step past this many times its estimate counts as this many


def batch_bucket(decodes: int) -> int:
    """1, 2, 3-4, 5-8, then multiples of 16: the batch sizes decode CUDA graphs are captured for,
    whose steps cost about the same."""
    if decodes <= 8:
        return max(0, (decodes - 1).bit_length())
    return 3 + -(-decodes // 16)


class StepSlack:
    """The measured step costs of one engine, its credit under `target_s`, and the prompt room
    they leave."""

    def __init__(self, target_s: float, smoothing: float = 0.2) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s: {target_s}; a step-time target must be positive")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: {smoothing}; must be in (0, 1]")
        self.target_s = target_s
        self._smoothing = smoothing
        self._decode_s: dict[int, float] = {}  # batch bucket -> decode-only step seconds
        self._token_s: float | None = None  # seconds a prompt token adds to a decoding step
        self.credit_s = 0.0  # seconds the decoding steps so far ran under the target (net)
        self._since_prompt = 0  # decoding steps since the last one that carried prompt tokens
        # Predicted excess of chunks planned but not yet measured (a step is planned while the
        # one before it runs): spent from the credit until their own times come in.
        self._pending_s: deque[float] = deque(maxlen=2)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step that ran `decodes` decode rows and `prompt_tokens` prompt tokens in `seconds`
        (steps without decode rows hold up no running sequence and are ignored)."""
        if decodes <= 0 or seconds < 0:
            return
        bound = CREDIT_STEPS * self.target_s
        self.credit_s = max(-bound, min(bound, self.credit_s + self.target_s - seconds))
        bucket = batch_bucket(decodes)
        base = self._decode_s.get(bucket)
        if prompt_tokens == 0:
            self._since_prompt += 1
            if base is None:
                self._decode_s[bucket] = seconds
            else:  # one stalled step (a compile, a host hiccup) moves the estimate a bounded step
                self._decode_s[bucket] = base + self._smoothing * (min(seconds, OUTLIER * base) - base)
            return
        self._since_prompt = 0
        if self._pending_s:
            self._pending_s.popleft()
        if base is None:
            # While prompts keep waiting every step carries some, and a batch size reached only
            # then would never get a decode-only step to measure: its decode step is inferred
            # from this one and the token cost, or room would stay a probe for good.
            if self._token_s:
                self._decode_s[bucket] = max(0.0, seconds - prompt_tokens * self._token_s)
            return
        per = max(0.0, seconds - base) / prompt_tokens
        self._token_s = per if self._token_s is None else self._token_s + self._smoothing * (per - self._token_s)

    def took(self, decodes: int, prompt_tokens: int) -> None:
        """A step was planned with `prompt_tokens` beside `decodes` decode rows (from `room`)."""
        if decodes <= 0 or prompt_tokens <= 0:
            return
        self._since_prompt = 0
        base = self._decode_s.get(batch_bucket(decodes))
        excess = 0.0 if base is None or not self._token_s else base + prompt_tokens * self._token_s - self.target_s
        self._pending_s.append(max(0.0, excess))

    def decode_step_s(self, decodes: int) -> float | None:
        """The smoothed decode-only step at this batch; None before one was measured."""
        return self._decode_s.get(batch_bucket(decodes))

    def room(self, decodes: int) -> int:
        """Prompt tokens the next step of `decodes` decode rows may carry (0: none this step)."""
        base = self._decode_s.get(batch_bucket(decodes))
        if base is None or not self._token_s:  # unknown, or lost in the steps' noise so far
            tokens = PROBE_TOKENS if self.credit_s >= 0 else 0
        else:
            credit = self.credit_s - sum(self._pending_s)
            tokens = max(0, int((credit + self.target_s - base) / self._token_s))
        if tokens < MIN_PROMPT_TOKENS:
            return MIN_PROMPT_TOKENS if self._since_prompt >= STARVE_STEPS else 0
        return tokens

    def prompt_tokens_per_s(self, decodes: int, cap: int | None = None) -> float | None:
        """Prompt tokens a second this engine works off beside `decodes` decode rows while its
        steps keep to the target (`cap`: at most that many a step), what a router weighs before
        it sends a prompt here; None until the decode step at this batch is measured.

        As `room` plans them: each step at the target carries (target - base) / per_token
        tokens (PROBE_TOKENS while the token cost is not known); over the target only the
        starving prompt's MIN_PROMPT_TOKENS move, once every STARVE_STEPS + 1 steps."""
        base = self._decode_s.get(batch_bucket(decodes))
        if decodes <= 0 or base is None:
            return None
        if base >= self.target_s:
            return MIN_PROMPT_TOKENS / ((STARVE_STEPS + 1) * base)
        per = self._token_s or 0.0
        tokens = (self.target_s - base) / per if per else float(PROBE_TOKENS)
        if cap is not None:
            tokens = min(tokens, float(max(cap, 0)))
        return tokens / (base + tokens * per)
