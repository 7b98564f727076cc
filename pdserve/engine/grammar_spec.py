"""What a request's structured output must match: a JSON schema, any JSON object, a regex, one of
a list of strings, or an EBNF grammar (vLLM's guided decoding). Checked where it is made, with
xgrammar's parser (no tokenizer needed), so a bad schema is the request's error naming the field,
never a worker's fault; `pdserve.engine.grammar` compiles it against the vocabulary."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 65_536  # a schema, regex or grammar longer than this is refused: compiling it is the worker's time
MAX_CHOICES = 1_024
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # OpenAI's json_object: a JSON object, of any content

# xgrammar's errors start with a time and its source position: "[17:55:09] /x/y.cc:83: message".
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json_schema` (a JSON Schema, as JSON text or a dict; kept as canonical
    JSON text), `json_object` (any JSON object), `regex`, `choice` (the output is one of these
    strings) or `grammar` (xgrammar's EBNF). Errors name the field as `structured_output.<kind>`."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"structured_output.json_object: must be a boolean, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                "structured_output: set exactly one of json_schema, json_object, regex, choice, grammar"
                f" (got {', '.join(given) or 'none'})"
            )
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
                raise ValueError(
                    f"structured_output.{kind}: must be a non-empty string of at most {MAX_SPEC_CHARS} characters"
                )
        _check_syntax(self)

    @property
    def kind(self) -> str:
        """Which of the five it is: json_schema, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def ebnf_of_choice(self) -> str:
        """The choice list as an EBNF grammar: JSON string literals are EBNF string literals."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice or ())


def _schema_text(schema: Any) -> str:
    """Compact JSON text of a schema, so that one schema is one cache entry however it was spaced.
    Keys keep their order: a schema's property order is the order the output writes them in."""
    field = "structured_output.json_schema"
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"{field}: longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{field}: not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        # ValueError like every refusal here: callers answer it as the request's fault.
        raise ValueError(f"{field}: must be a JSON object (a JSON Schema), got {type(schema).__name__}")  # noqa: TRY004
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{field}: not valid JSON ({exc})") from None
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}: longer than {MAX_SPEC_CHARS} characters")
    return text


def _choices(choice: Any) -> tuple[str, ...]:
    field = "structured_output.choice"
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise ValueError(f"{field}: must be a list of strings")  # noqa: TRY004 (the request's fault, as above)
    if not choice or len(choice) > MAX_CHOICES:
        raise ValueError(f"{field}: must list 1 to {MAX_CHOICES} strings, got {len(choice)}")
    if not all(isinstance(c, str) and c for c in choice):
        raise ValueError(f"{field}: every choice must be a non-empty string")
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}: longer than {MAX_SPEC_CHARS} characters in all")
    for c in choice:
        try:
            c.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{field}: not valid Unicode (a lone surrogate at index {exc.start})") from None
    return tuple(choice)


def _check_syntax(spec: StructuredOutput) -> None:
    """Parse the spec with xgrammar (no vocabulary involved): ValueError naming the field when it
    does not parse or uses what xgrammar does not support."""
    import xgrammar as xgr  # imported here: only requests with structured output need it

    kind = spec.kind
    try:
        if kind in ("json_schema", "json_object"):
            xgr.Grammar.from_json_schema(spec.json_schema or JSON_OBJECT_SCHEMA, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex or "")
        elif kind == "choice":
            xgr.Grammar.from_ebnf(spec.ebnf_of_choice())
        else:
            xgr.Grammar.from_ebnf(spec.grammar or "")
    except (RuntimeError, ValueError) as exc:
        reason = _NATIVE_PREFIX.sub("", str(exc).strip()).splitlines()
        why = reason[0] if reason else "refused by the grammar compiler"
        raise ValueError(f"structured_output.{kind}: {why}") from None
