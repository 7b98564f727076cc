"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pdserve.engine.grammar_spec import StructuredOutput

# Above this every token is about equally likely; a larger value is far more likely a mistake
# (a typo, a value in the wrong unit) than a wish, so it is refused rather than silently flattened.
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1  # the gRPC field is a uint64
MAX_TOKEN_ID = 2**32 - 1  # token ids travel as uint32
MAX_PENALTY = 2.0  # presence/frequency penalty bound, as OpenAI's API has it
MAX_REPETITION_PENALTY = 100.0  # beyond it every seen token is as good as banned: a mistake, not a wish
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 bans or forces a token
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_N = 16  # completions of one prompt per request (`n`): each is a sequence on a decode worker


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop. Names and meanings follow
    vLLM's SamplingParams; every value is range-checked here, naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many most likely tokens per position, with theirs
    # vLLM's: each prompt token's logprob given those before it, with this many most likely
    # tokens at its position (pdserve.engine.prompt_logprobs); None: not computed.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or, if negative, multiplies) logits of prompt and output tokens
    # token id -> added to its logit; a dict is accepted and frozen into sorted (id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are out
    # Tokens of this request already generated elsewhere, now part of the prompt (a decode
    # worker recomputing after a failed transfer, a stream resumed on another worker): a seeded
    # request's i-th token here draws as token output_offset + i, as it would have there.
    output_offset: int = 0
    # Structured output: the tokens are constrained to what this grammar accepts (pdserve.engine.grammar).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be integers, got {list(self.stop_token_ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        _finite("temperature", self.temperature)
        _finite("top_p", self.top_p)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: must be an integer in [0, 2^64), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop: stop strings must be non-empty strings, got {s!r}")
            _unicode("stop", s)
        if any(not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, 2^32), got {list(self.stop_token_ids)}")
        self._check_processing()
        if not isinstance(self.output_offset, int) or self.output_offset < 0:
            raise ValueError(f"output_offset: must be an integer >= 0, got {self.output_offset!r}")
        self._check_structured_output()

    def _check_structured_output(self) -> None:
        """A grammar ends the output with EOS: ignore_eos and min_tokens would fight it."""
        so = self.structured_output
        if so is None:
            return
        if not isinstance(so, StructuredOutput):
            raise ValueError(f"structured_output: expected a StructuredOutput, got {type(so).__name__}")
        if self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured output, whose grammar ends with EOS")
        if self.min_tokens:
            raise ValueError("min_tokens: cannot be combined with structured output, whose grammar decides the length")

    def _check_processing(self) -> None:
        """Freeze and range-check the penalties, the logit bias, min_tokens and top_logprobs."""
        for name in ("presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name))
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        _finite("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(t, b) for t, b in items]
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: must map token ids to numbers, got {bias!r}") from None
        for t, b in pairs:
            if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"logit_bias: keys must be token ids in [0, 2^32), got {t!r}")
            _finite(f"logit_bias[{t}]", b)
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{t}]: must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias: a token id appears twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or not 0 <= pl <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {pl!r}")

    def after(self, generated: int) -> SamplingParams:
        """The params that go on with this request after `generated` of its tokens were made
        elsewhere and are now part of its prompt: the budget shrinks by that many, and a seeded
        request keeps drawing as it would have. ValueError if nothing of the budget would be left."""
        if not isinstance(generated, int) or generated < 0:
            raise ValueError(f"generated: must be an integer >= 0, got {generated!r}")
        if generated >= self.max_tokens:
            raise ValueError(f"generated: {generated} tokens leave nothing of max_tokens={self.max_tokens}")
        return replace(
            self,
            max_tokens=self.max_tokens - generated,
            min_tokens=max(0, self.min_tokens - generated),
            output_offset=self.output_offset + generated,
            # The prompt's scores came with the first token; a longer prompt is not the client's.
            prompt_logprobs=self.prompt_logprobs if generated == 0 else None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the penalties need the sequence's token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before the draw (a greedy row is then no plain argmax)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value: object) -> None:
    """ValueError naming `name` unless `value` is a finite real number (NaN compares false with
    every bound, so a range check alone would let it through)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    try:
        ok = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise ValueError(f"{name}: must be a finite number, got {value!r}")


def _unicode(name: str, text: str) -> None:
    """ValueError naming `name` for text that is not valid Unicode (a lone surrogate), which no
    tokenizer or UTF-8 encoder can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name}: not valid Unicode (a lone surrogate at index {exc.start})") from None
