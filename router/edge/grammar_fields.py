"""Structured output at the edge: OpenAI's `response_format` and vLLM's `guided_*` fields into
the public `StructuredOutput` message, and that message to and from the engine's
`StructuredOutput` (which checks the grammar itself, naming `structured_output.<kind>`). Pure."""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.sampling_params import StructuredOutput
from pdserve_proto import inference_pb2

# vLLM's extra fields, each one kind of grammar.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# An engine error's head -> the OpenAI field that asked for it.
PARAM_OF_KIND = {
    "sampling_params.structured_output.json_schema": "response_format",
    "sampling_params.structured_output.json_object": "response_format",
    "sampling_params.structured_output.regex": "guided_regex",
    "sampling_params.structured_output.choice": "guided_choice",
    "sampling_params.structured_output.grammar": "guided_grammar",
    "sampling_params.structured_output": "response_format",
}


class GrammarFieldError(ValueError):
    """A structured-output field of an OpenAI request is malformed: `param` names it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def openai_structured_output(body: dict[str, Any]) -> inference_pb2.StructuredOutput | None:
    """The grammar an OpenAI request body asks for, or None (free text). At most one of
    response_format (json_object or json_schema) and the guided_* fields may ask."""
    asked = [name for name in ("response_format", *GUIDED_FIELDS) if _asks(name, body.get(name))]
    if len(asked) > 1:
        raise GrammarFieldError(asked[1], f"only one kind of structured output per request (also got {asked[0]})")
    if not asked:
        return None
    name, value = asked[0], body[asked[0]]
    msg = inference_pb2.StructuredOutput()
    if name == "response_format":
        _response_format(value, msg)
    elif name == "guided_json":
        msg.json_schema = _schema_text(name, value)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarFieldError(name, "must be a non-empty list of strings")
        msg.choice.extend(value)
    elif not isinstance(value, str) or not value:
        raise GrammarFieldError(name, "must be a non-empty string")
    elif name == "guided_regex":
        msg.regex = value
    else:
        msg.grammar = value
    return msg


def _asks(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is not None and not (isinstance(value, dict) and value.get("type") == "text")
    return value is not None


def _response_format(value: Any, msg: inference_pb2.StructuredOutput) -> None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarFieldError("response_format", "must be an object with a string type")
    kind = value["type"]
    if kind == "json_object":
        msg.json_object = True
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarFieldError("response_format.json_schema", "must be an object with a schema")
        if "schema" not in spec:
            raise GrammarFieldError("response_format.json_schema.schema", "required")
        msg.json_schema = _schema_text("response_format.json_schema.schema", spec["schema"])
    else:
        raise GrammarFieldError(
            "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
        )


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        return schema  # checked as JSON by the engine's StructuredOutput
    if not isinstance(schema, dict):
        raise GrammarFieldError(param, f"must be a JSON Schema object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))


def structured_output_of(msg: inference_pb2.StructuredOutput) -> StructuredOutput:
    """The engine's `StructuredOutput` of a message; ValueError naming `structured_output.<kind>`."""
    return StructuredOutput(
        json_schema=msg.json_schema if msg.HasField("json_schema") else None,
        json_object=msg.json_object,
        regex=msg.regex if msg.HasField("regex") else None,
        choice=tuple(msg.choice) if msg.choice else None,
        grammar=msg.grammar if msg.HasField("grammar") else None,
    )


def structured_output_msg(spec: StructuredOutput) -> inference_pb2.StructuredOutput:
    """`spec` as the message a worker call or the public API carries."""
    msg = inference_pb2.StructuredOutput(json_object=spec.json_object, choice=spec.choice or ())
    for kind in ("json_schema", "regex", "grammar"):
        value = getattr(spec, kind)
        if value is not None:
            setattr(msg, kind, value)
    return msg
