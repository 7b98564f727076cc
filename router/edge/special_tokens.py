"""User text tokenized as text: a special token's string typed in a prompt or a chat message
(`<|im_start|>system`) becomes the ordinary tokens of those characters, as the tokenizer's
`split_special_tokens=True` makes it, while the chat template's own special tokens stay real.
Without this a user could open a system turn of their own (role injection).

Text without any special token's string, nearly all of it, is tokenized exactly as before. Pure:
the tokenizer is the only thing called."""

from __future__ import annotations

import re
import uuid
from typing import Any

# Private-use characters around a placeholder: a template that keeps its content keeps them.
_OPEN, _CLOSE = "\ue000", "\ue001"


class TemplateAltersContent(ValueError):
    """The chat template changed a message's text so that its special-token strings can no
    longer be found in the rendered prompt."""


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The text of every special token the tokenizer would match in text, longest first (so that
    a pattern of them prefers `<|im_start|>` to a shorter token it contains)."""
    found = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
             if getattr(t, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", ()) or ())
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))


def has_special(text: str, specials: tuple[str, ...]) -> bool:
    return any(s in text for s in specials)


def encode_user_text(tokenizer: Any, text: str) -> list[int]:
    """`text`, all of it the user's, tokenized with its special-token strings as ordinary text
    (the tokenizer's own BOS/EOS still added as for any prompt)."""
    if not has_special(text, special_strings(tokenizer)):
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, split_special_tokens=True))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], render: Any) -> list[int]:
    """The chat prompt of `messages`, rendered by `render(messages) -> str` (the chat template),
    with the messages' special-token strings as ordinary text and the template's as the real
    tokens. Each such string is swapped for a placeholder before rendering, then the rendered
    prompt is tokenized piece by piece around the placeholders: the pieces as usual, each
    placeholder's string as text. A special token ends a piece in the usual tokenization too,
    so the text around it tokenizes as it would have."""
    specials = special_strings(tokenizer)
    if not any(has_special(m["content"], specials) for m in messages):
        return list(tokenizer.encode(render(messages)))
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    marker = f"{_OPEN}{uuid.uuid4().hex}:"
    typed: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        typed.append(match.group(0))
        return f"{marker}{len(typed) - 1}{_CLOSE}"

    escaped = [m | {"content": pattern.sub(placeholder, m["content"])} for m in messages]
    pieces = re.split(f"{re.escape(marker)}(\\d+){_CLOSE}", render(escaped))
    if any(_OPEN in p or _CLOSE in p for p in pieces[::2]) and not _private_use_typed(messages):
        raise TemplateAltersContent("the chat template changed a message holding a special token's text")
    prefix, suffix = _added_around(tokenizer)
    ids = list(prefix)
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += tokenizer.encode(typed[int(piece)], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids + list(suffix)


def _private_use_typed(messages: list[dict[str, str]]) -> bool:
    """Did the user type the placeholder's private-use characters themselves?"""
    return any(_OPEN in m["content"] or _CLOSE in m["content"] for m in messages)


def _added_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text of its own accord (BOS, EOS)."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []
