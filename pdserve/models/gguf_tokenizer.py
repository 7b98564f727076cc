"""The tokenizer files of a converted GGUF: tokenizer.json, tokenizer_config.json, special tokens.

Byte-level BPE vocabularies (llama.cpp "gpt2") are rebuilt with `tokenizers`, with the
pre-tokenizer llama.cpp uses for the file; other vocabularies go through transformers' GGUF
tokenizer conversion. BOS/EOS are added the way llama.cpp adds them for the file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf

from pdserve.models.gguf_fields import GgufFields

logger = logging.getLogger(__name__)

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) that split every digit apart
# before the GPT-2 regex (llama.cpp: "\p{N}" then the GPT-2 pattern).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
# Names that use Llama 3's split regex (and ignore_merges, as llama.cpp does for them).
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer_files(fields: GgufFields, src: Path, max_len: int) -> dict[str, Any]:
    """File name -> content (str for tokenizer.json, dict for the JSON configs); {} if no tokenizer."""
    kind = fields.get("tokenizer.ggml.model")
    if kind is None:
        logger.warning("%s carries no tokenizer; writing weights and config only", src)
        return {}
    tokens: list[str] = fields.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(fields, tokens, src)
    else:
        tokenizer = _tokenizer_via_transformers(src, kind)
    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless told otherwise.
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    _set_bos_eos_template(tokenizer, fields, tokens, add_bos, add_eos)

    def token_of(key: str) -> str | None:
        idx = fields.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special = {
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
    }
    special = {k: v for k, v in special.items() if v is not None}
    added = {
        str(idx): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for idx, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": added,
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True),
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
    }


def _byte_level_bpe(fields: GgufFields, tokens: list[str], src: Path) -> Any:
    """GPT-2-style byte-level BPE (llama.cpp tokenizer model "gpt2"), built with `tokenizers`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        vocab.setdefault(tok, idx)  # keep the first id if a file repeats a token
    merges: list[tuple[str, str]] = []
    for merge in fields.get("tokenizer.ggml.merges", []):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{src}: malformed tokenizer merge {merge!r}")
        merges.append((parts[0], parts[1]))

    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE:
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            logger.warning("%s: unknown pre-tokenizer %r, using the GPT-2 split", src, pre)
        pre_tok = byte_level

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE)
    )
    tokenizer.pre_tokenizer = pre_tok
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (type 3) and the ids the file names as bos/eos/unk/pad must be
    # matched whole and hidden by skip_special_tokens; user-defined ones (type 4) are
    # matched whole but are ordinary text.
    types = fields.get("tokenizer.ggml.token_type", [])
    special_ids = {
        fields.get(k)
        for k in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id",
        )
    }
    special_ids.discard(None)
    special_ids |= {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    special_tokens = [
        AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids) if i < len(tokens)
    ]
    user_tokens = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == gguf.TokenType.USER_DEFINED and i not in special_ids
    ]
    if special_tokens:
        tokenizer.add_special_tokens(special_tokens)
    if user_tokens:
        tokenizer.add_tokens(user_tokens)

    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _set_bos_eos_template(tokenizer: Any, fields: GgufFields, tokens: list[str], add_bos: bool, add_eos: bool) -> None:
    """Make ``encode`` add BOS/EOS the way llama.cpp does for this file, inside tokenizer.json
    itself, so every loader (tokenizers, transformers) agrees without extra flags."""
    from tokenizers import processors

    steps = [tokenizer.post_processor] if isinstance(tokenizer.post_processor, processors.ByteLevel) else []
    if add_bos or add_eos:
        bos_id = fields.require("tokenizer.ggml.bos_token_id") if add_bos else None
        eos_id = fields.require("tokenizer.ggml.eos_token_id") if add_eos else None
        bos = [tokens[bos_id]] if bos_id is not None else []
        eos = [tokens[eos_id]] if eos_id is not None else []

        def template(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in bos] + [f"{seq}:{type_id}"] + [f"{t}:{type_id}" for t in eos]

        steps.append(
            processors.TemplateProcessing(
                single=template("$A", 0),
                pair=template("$A", 0) + template("$B", 1),
                special_tokens=[(tokens[i], i) for i in (bos_id, eos_id) if i is not None],
            )
        )
    tokenizer.post_processor = processors.Sequence(steps) if len(steps) > 1 else (steps[0] if steps else None)


def _tokenizer_via_transformers(src: Path, kind: str) -> Any:
    """Non-byte-level vocabularies (e.g. sentencepiece "llama") need merges rebuilt from scores;
    transformers' GGUF tokenizer conversion already does that, so defer to it."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as exc:
        raise ValueError(
            f"{src}: tokenizer model {kind!r} needs transformers' GGUF tokenizer conversion, "
            f"which is not available ({exc})"
        ) from exc
    try:
        arch, tokenizer_dict, _ = get_gguf_tokenizer(str(src))
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as exc:
        raise ValueError(f"{src}: cannot convert tokenizer model {kind!r}: {exc}") from exc
    return backend
