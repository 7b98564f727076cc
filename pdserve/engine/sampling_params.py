"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    # Tokens of this request already generated elsewhere, now part of the prompt (a decode
    # worker recomputing after a failed transfer, a stream resumed on another worker): a seeded
    # request's i-th token here draws as token output_offset + i, as it would have there.
    output_offset: int = 0

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        if not isinstance(self.output_offset, int) or self.output_offset < 0:
            raise ValueError(f"output_offset: must be an integer >= 0, got {self.output_offset!r}")

    def after(self, generated: int) -> SamplingParams:
        """The params that go on with this request after `generated` of its tokens were made
        elsewhere and are now part of its prompt: the budget shrinks by that many, and a seeded
        request keeps drawing as it would have. ValueError if nothing of the budget would be left."""
        if not isinstance(generated, int) or generated < 0:
            raise ValueError(f"generated: must be an integer >= 0, got {generated!r}")
        if generated >= self.max_tokens:
            raise ValueError(f"generated: {generated} tokens leave nothing of max_tokens={self.max_tokens}")
        return replace(self, max_tokens=self.max_tokens - generated, output_offset=self.output_offset + generated)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
