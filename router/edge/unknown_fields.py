"""Fields of a gRPC request that this server's messages do not define. Protobuf keeps them aside
when it parses (a client built from a newer or another .proto sent them), and nothing reads
them: the server would silently drop what the client asked for. `unknown_fields` names them,
by field number under their message's path, so that the server can refuse the request, as the
HTTP API refuses a field it does not know (`--allow-unknown-fields` lets both ignore them).
Pure: no I/O."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Each unknown field of `message` and of the messages it holds, as `path` + its number
    (`17`, `sampling_params.99`, `messages[2].5`), each once, in the order found. A number the
    message defines, sent with another wire type (protobuf keeps that aside too), is marked so."""
    known = message.DESCRIPTOR.fields_by_number
    found = [f"{path}{f.field_number}" + (" (the wrong wire type)" if f.field_number in known else "")
             for f in UnknownFieldSet(message)]
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.message_type is not None:
                for key, item in value.items():
                    found += unknown_fields(item, f"{path}{fd.name}[{key!r}].")
        elif _is_repeated(fd):
            for i, item in enumerate(value):
                found += unknown_fields(item, f"{path}{fd.name}[{i}].")
        else:
            found += unknown_fields(value, f"{path}{fd.name}.")
    return list(dict.fromkeys(found))


def _is_repeated(fd: FieldDescriptor) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    return bool(is_repeated) if is_repeated is not None else fd.label == FieldDescriptor.LABEL_REPEATED


def unknown_fields_message(names: list[str]) -> str:
    """The refusal's text: the field numbers, and how to let the server ignore them."""
    return (f"unknown fields {', '.join(names)}: field numbers this server's API does not define "
            "(--allow-unknown-fields lets the server ignore them)")
