"""The detokenizer's decode straight from a Hugging Face tokenizer's `tokenizers` backend gives
exactly the library's `decode(ids, skip_special_tokens=True)`, and is taken only where it does."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.detokenizer import IncrementalDetokenizer, text_decoder

_TEXT = ["Grüße aus Köln: 日本語のテキスト 🙂🚀 and plain ascii. " * 3, "the quick brown fox jumps over the lazy dog ."]


@pytest.fixture(scope="module")
def backend() -> Tokenizer:
    """A small byte-level BPE (multi-byte characters span tokens) with special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT, trainer)
    return tok


def _fast(backend: Tokenizer, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", **kwargs)


def test_the_backend_decode_equals_the_library_decode_special_tokens_and_split_characters_included(backend):
    tok = _fast(backend, clean_up_tokenization_spaces=False)
    decode = text_decoder(tok)
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 6))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_the_backend_path_is_taken_where_it_is_exact(backend):
    tok = _fast(backend, clean_up_tokenization_spaces=False)

    def library_path(*args, **kwargs):
        raise AssertionError("the library's decode was called")

    tok.decode = library_path  # on the instance: the class's decode is still the library's
    assert text_decoder(tok)([5, 6]) == backend.decode([5, 6], skip_special_tokens=True)


def test_streamed_text_is_the_same_through_either_decode(backend):
    tok = _fast(backend, clean_up_tokenization_spaces=False)
    ids = tok.encode(_TEXT[0] + "</s>" + _TEXT[1], add_special_tokens=False)

    def stream(detok: IncrementalDetokenizer) -> list[str]:
        pieces = []
        for t in ids:
            detok.add([t])
            pieces.append(detok.stream_delta(finished=False))
        return pieces + [detok.stream_delta(finished=True)]

    slow = IncrementalDetokenizer(tok)
    slow._decode = lambda window: tok.decode(window, skip_special_tokens=True)
    slow._stream = None  # the windows decoded here, through the library's decode
    fast = IncrementalDetokenizer(tok)
    assert fast._stream is not None, "the backend's DecodeStream is taken where the backend decode is exact"
    assert stream(fast) == stream(slow)
    assert fast._stream is not None, "the stream ran to the end without handing over"


def test_a_stream_that_refuses_a_token_hands_over_to_the_windows_with_the_same_text(backend):
    tok = _fast(backend, clean_up_tokenization_spaces=False)
    ids = tok.encode(_TEXT[0], add_special_tokens=False)
    windowed = IncrementalDetokenizer(tok)
    windowed._stream = None
    for t in ids:
        windowed.add([t])
    for fail_at in (1, 7, len(ids) // 2, len(ids) - 1):
        detok = IncrementalDetokenizer(tok)
        detok._stream = _Refusing(detok._stream, fail_at)
        for i in range(0, len(ids), 3):  # several tokens an add, as a resumed stream adds them
            detok.add(ids[i : i + 3])
        assert detok._stream is None
        assert detok.text == windowed.text == tok.decode(ids, skip_special_tokens=True), fail_at


class _OwnDecode(PreTrainedTokenizerFast):
    def decode(self, token_ids, skip_special_tokens=False, **kwargs):  # a model's own decode
        return "own:" + super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


def test_a_tokenizer_with_its_own_decode_or_a_space_clean_up_keeps_the_library_path(backend):
    own = _OwnDecode(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    assert text_decoder(own)([5, 6]) == own.decode([5, 6], skip_special_tokens=True)
    assert text_decoder(own)([5, 6]).startswith("own:")
    cleaned = _fast(backend, clean_up_tokenization_spaces=True)
    ids = cleaned.encode("fox .", add_special_tokens=False)
    assert text_decoder(cleaned)(ids) == cleaned.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_is_not_a_hugging_face_one_is_called_as_it_is():
    class Letters:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(97 + i) for i in ids)

    assert text_decoder(Letters())([0, 1, 2]) == "abc"


class _Refusing:
    """A DecodeStream that raises as the library does after `fail_at` tokens."""

    def __init__(self, real, fail_at: int) -> None:
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def step(self, backend, token):
        self.calls += 1
        if self.calls > self.fail_at:
            raise Exception("Invalid prefix encountered")  # noqa: TRY002 - the library raises a plain Exception
        return self.real.step(backend, token)
