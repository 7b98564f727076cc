"""pdserve: disaggregated prefill/decode LLM serving.

`LLM`, `SamplingParams` and `RequestOutput` load on first use, so that importing a part that
needs none of the engine's device code (the router, the CLI's --help) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.engine import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

_LAZY = {
    "LLM": "pdserve.llm",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestOutput": "pdserve.engine.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
