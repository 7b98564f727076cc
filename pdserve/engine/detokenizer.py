"""Tokenizer loading, incremental detokenization and stop strings."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's Hugging Face tokenizer, or None when the directory ships none."""
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _exact_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers` backend of a Hugging Face tokenizer whose decode is the library's own and
    cleans up no spaces (so the backend's decode is exactly the tokenizer's), else None."""
    transformers = sys.modules.get("transformers")  # a tokenizer of its own needs it imported
    fast = getattr(transformers, "PreTrainedTokenizerFast", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        fast is not None and isinstance(tokenizer, fast) and backend is not None
        and cls.decode is fast.decode and cls._decode is fast._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False
    ):
        return backend
    return None


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`. For a `tokenizers`-backed Hugging Face
    tokenizer whose decode is the library's own and cleans up no spaces, that is exactly the
    backend's decode, called here directly: the library's path around it costs several times the
    decode itself, and a stream decodes twice per token."""
    return _decoder(tokenizer, _exact_backend(tokenizer))


def _decoder(tokenizer: Any, backend: Any | None) -> Callable[[list[int]], str]:
    """`text_decoder` with `_exact_backend(tokenizer)` already found."""
    if backend is not None:
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _decode_stream() -> Any | None:
    """A `tokenizers` DecodeStream (tokenizers >= 0.21), or None: the windowed
    decode below as one call per token inside the library, about a third of its cost."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream(skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always valid UTF-8.

    Decoding token by token breaks multi-byte characters and merged-space rules, so each delta
    is the decode of a short window of recent tokens minus the decode of its already-emitted
    head; a window ending in an incomplete character (U+FFFD) waits for the next token.
    Stop strings cut the text at their first occurrence; text that could still become a stop
    string is held back from streaming until it is decided.
    """

    def __init__(self, tokenizer: Any | None, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        # Where the backend's decode is exact, it decodes directly, and the library runs the
        # same windows itself.
        self._backend = _exact_backend(tokenizer) if tokenizer is not None else None
        self._decode = _decoder(tokenizer, self._backend) if tokenizer is not None else None
        self._stream = _decode_stream() if self._backend is not None else None

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched, if any (the text is then cut)."""
        if self.tokenizer is None:
            return None
        start = len(self.tokens)
        self.tokens.extend(token_ids)
        delta = self._streamed(start) if self._stream is not None else self._windowed()
        if not delta:
            return None
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def _windowed(self) -> str:
        """The text the tokens since the last delta complete: the decode of a window of recent
        tokens minus that of its already-emitted head ("" while a character is incomplete)."""
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return full[len(prefix) :]

    def _streamed(self, start: int) -> str:
        """`_windowed` through the library's DecodeStream, fed the tokens from `start` on. A
        stream that refuses a token (a window whose decode rewrote its emitted head) hands over
        to `_windowed` from the last token it emitted text for."""
        text = ""
        stream, backend, tokens = self._stream, self._backend, self.tokens
        for i in range(start, len(tokens)):
            try:
                piece = stream.step(backend, tokens[i])
            except Exception:  # noqa: BLE001 - the library's error for that case is a plain Exception
                self._stream = None
                return text + self._windowed()
            if piece is not None:
                text += piece
                self._prefix_offset, self._read_offset = self._read_offset, i + 1  # as `_windowed` keeps them
        return text

    def stream_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer turn into a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self.holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
