"""The HTTP server's settings beside the API keys and input limits: how long a connection may
sit idle, send its headers or send its body, whether unknown request fields are ignored, and
tool_choice "auto" (vLLM's --enable-auto-tool-choice and --tool-call-parser). Pure configuration;
`router/edge/http_conn.py` applies the timeouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.router.edge.tool_parsers import PARSERS


@dataclass(frozen=True)
class HttpOptions:
    """Timeouts of one HTTP connection, in seconds, and the unknown-field policy.

    keep_alive_s: a connection with no request under way (before its first, or after an answer)
    is closed after this long, as uvicorn's `--timeout-keep-alive`. header_s: from a request's
    first byte, its headers must be complete within this long (a slowloris sender is cut off).
    body_s: from the end of the headers, the body must be complete within this long (408)."""

    keep_alive_s: float = 5.0
    header_s: float = 30.0
    body_s: float = 60.0
    allow_unknown_fields: bool = False  # `pdserve serve` passes it to the gRPC server too
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model's text is read for calls
    tool_call_parser: str | None = None  # how: router/edge/tool_parsers.py's PARSERS

    def __post_init__(self) -> None:
        for name in ("keep_alive_s", "header_s", "body_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: {value!r}; must be a positive number of seconds")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r}; one of {', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice (--enable-auto-tool-choice): needs a tool_call_parser (--tool-call-parser)"
            )

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto", None where auto tool choice is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None
