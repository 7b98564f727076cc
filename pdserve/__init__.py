"""pdserve: disaggregated prefill/decode LLM serving.

`LLM`, `SamplingParams` and `RequestOutput` load on first use, so that importing a part that
needs none of the engine's device code (the router, the CLI's --help) does not load torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
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


# A checkout keeps router/, kv_transfer/, prefill_worker/ and decode_worker/ beside pdserve/, and a
# wheel puts them inside it (pyproject's package-dir): this maps the four names onto the checkout's folders.
_SUBPACKAGES = ("router", "kv_transfer", "prefill_worker", "decode_worker")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `pdserve.<name>` in a checkout's top-level folder `<name>/`; its submodules follow its __path__."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        init = os.path.join(folder, "__init__.py")
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])


def _checkout_folders() -> dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    return {
        f"{__name__}.{name}": os.path.join(root, name)
        for name in _SUBPACKAGES
        if not os.path.isdir(os.path.join(here, name)) and os.path.isfile(os.path.join(root, name, "__init__.py"))
    }


def _add_checkout_finder() -> None:
    folders = _checkout_folders()
    if folders and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder(folders))


_add_checkout_finder()
