"""flash-attn-4's paged varlen forward, launched past its Python wrapper once the wrapper has
resolved a launch.

The wrapper spends most of its host time (170-180 µs a call on an H200's host) deciding which
compiled kernel to run and with what; prefill and mixed steps call it once per layer between
their graphed pieces, so short chunks waited on the host. `FA4Launcher` records the wrapper's
launch once per launch class and repeats it (docs/engine-kernels.md, "flash-attn over the paged pool";
figures in docs/engine-gpu.md).
"""

from __future__ import annotations

import bisect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

log = logging.getLogger(__name__)

# Versions whose wrapper decides an SM 9.x launch from no more than `launch_class` reads.
VERIFIED_VERSIONS = ("4.0.0b36",)
# Every query-tile height flash-attn-4 picks on Hopper is one of these, so a packed query length
# on one side of each bound decides "fits one tile" the same way for any of them.
_TILE_BOUNDS = (64, 128, 192, 256)
# Past this batch the wrapper builds a batch-lookup table per call (its BIN_BATCH_SEARCH_THRESH).
_LOOKUP_BATCH = 256

# Where each named tensor sits in a call's tuple (`_NAMES[i]` is slot i).
_NAMES = ("q", "k", "v", "out", "cu_seqlens_q", "seqused_k", "page_table")


@dataclass(frozen=True)
class LaunchTemplate:
    """A recorded launch: the compiled kernel and, per argument, a tensor slot or a constant."""

    kernel: Callable[..., Any]
    slots: tuple[int | None, ...]  # index into the call's tensors, or None for a constant
    constants: tuple[Any, ...]  # the value where the slot is None

    def launch(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.kernel(*[c if s is None else tensors[s] for s, c in zip(self.slots, self.constants)])


def _bcast(t: torch.Tensor) -> tuple[bool, ...]:
    return tuple(s == 0 for s in t.stride())


def launch_class(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_table: torch.Tensor,
    batch: int,
    max_seqlen_q: int,
    scale: float,
    causal: bool,
) -> tuple:
    """Everything flash-attn-4's wrapper reads to pick a Hopper launch for a paged varlen call."""
    packed_q = max_seqlen_q * (q.shape[1] // k.shape[2])  # queries per KV head, packed (GQA)
    return (
        q.device.index,
        q.dtype,
        k.dtype,
        tuple(q.shape[1:]),
        q.stride(),
        tuple(k.shape),
        k.stride(),
        tuple(v.shape),
        v.stride(),
        _bcast(page_table),
        page_table.stride(-1),
        scale,
        causal,
        bisect.bisect_left(_TILE_BOUNDS, packed_q),
        batch > _LOOKUP_BATCH,
    )


def name_launch(
    args: tuple[Any, ...], tensors: tuple[torch.Tensor, ...], host_ints: tuple[int, ...]
) -> tuple[tuple[int | None, ...], tuple[Any, ...]] | None:
    """Name each recorded argument as one of `tensors` (by address, shape and strides) or a
    constant; None where an argument is another tensor (computed in the call, or a copy), two
    tensors share an address, or a constant equals one of this call's lengths (`host_ints`),
    which a later call of the class would not share."""
    by_ptr: dict[int, int] = {}
    for i, t in enumerate(tensors):
        ptr = t.data_ptr()
        if ptr in by_ptr:
            return None
        by_ptr[ptr] = i
    slots: list[int | None] = []
    constants: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            i = by_ptr.get(a.data_ptr())
            if i is None or a.shape != tensors[i].shape or a.stride() != tensors[i].stride() or a.dtype != tensors[i].dtype:
                return None
            slots.append(i)
            constants.append(None)
        elif type(a) is int and a in host_ints:
            return None
        else:
            slots.append(None)
            constants.append(a)
    if slots.count(_NAMES.index("out")) != 1 or _NAMES.index("q") not in slots:
        return None
    return tuple(slots), tuple(constants)


class _WatchedCache:
    """Stands in for the wrapper's compile cache during one call and keeps what it launches."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.launches: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __setitem__(self, key: object, value: Any) -> None:
        self._cache[key] = value

    def __getitem__(self, key: object) -> Callable[..., Any]:
        kernel = self._cache[key]

        def recorded(*args: Any) -> Any:
            self.launches.append((kernel, args))
            return kernel(*args)

        return recorded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def fast_launch_supported(device: torch.device) -> tuple[bool, str]:
    """Whether this flash-attn-4 and this card are ones `launch_class` was checked against."""
    try:
        version = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return False, "flash-attn-4's version is unknown"
    if version not in VERIFIED_VERSIONS:
        return False, f"flash-attn-4 {version} is not one of {VERIFIED_VERSIONS}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False, "the card is not Hopper (SM 9.x)"
    return True, ""


class FA4Launcher:
    """Calls flash-attn-4's paged varlen forward, launching recorded kernels where it can.

    A launch class (`launch_class`) holds everything the wrapper's decision reads, as flash-attn-4
    4.0.0b36 makes it on Hopper (SM 9.x): dtypes, head counts and dims, the cache's shape and
    strides, broadcast patterns, scale, causality, the packed query length's place against the
    query tiles, and whether the batch is past the size where the wrapper adds a per-call lookup
    table. The first call of a class goes through the wrapper with its compile cache watched; the
    compiled kernel it launches and its arguments are kept, each named as one of the call's tensors
    (by address) or a constant. Later calls launch that kernel with their own tensors and a fresh
    output, as the wrapper would. A class whose launch cannot be named so (an argument computed
    per call, a copied input, more than one launch) keeps the wrapper, as does every call on
    another architecture or flash-attn-4 version.
    """

    def __init__(self, varlen: Callable[..., Any], enabled: bool = True) -> None:
        self._varlen = varlen
        self._forward = sys.modules[varlen.__module__]._flash_attn_fwd
        self.enabled = enabled
        self._checked = False
        self._templates: dict[tuple, LaunchTemplate | None] = {}
        self.fast_calls = 0
        self.wrapper_calls = 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seqused_k: torch.Tensor,
        page_table: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        scale: float,
    ) -> torch.Tensor:
        if not self._checked and self.enabled:
            self._checked = True
            self.enabled, why = fast_launch_supported(q.device)
            if not self.enabled:
                log.info("flash-attn-4 calls go through its wrapper: %s", why)
        batch = seqused_k.shape[0]
        if not self.enabled or q.shape[0] == 0:
            return self._wrapper(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale)
        key = launch_class(q, k, v, page_table, batch, max_seqlen_q, scale, True)
        template = self._templates.get(key, False)
        if template is False:
            return self._record(key, q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale)
        # q's strides are part of the class; only its address can break the wrapper's alignment rule.
        if template is None or q.data_ptr() % 16:
            return self._wrapper(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale)
        out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
        template.launch((q, k, v, out, cu_seqlens_q, seqused_k, page_table))
        self.fast_calls += 1
        return out

    def _wrapper(self, q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale) -> torch.Tensor:
        self.wrapper_calls += 1
        out, _ = self._varlen(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens_q,
            seqused_k=seqused_k,
            page_table=page_table,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=True,
        )
        return out

    def _record(self, key, q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale) -> torch.Tensor:
        cache = self._forward.compile_cache
        watched = _WatchedCache(cache)
        self._forward.compile_cache = watched
        try:
            out = self._wrapper(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, scale)
        finally:
            self._forward.compile_cache = cache
        named = None
        if len(watched.launches) == 1:
            kernel, args = watched.launches[0]
            tensors = (q, k, v, out, cu_seqlens_q, seqused_k, page_table)
            host_ints = (q.shape[0], seqused_k.shape[0], max_seqlen_q, max_seqlen_k)
            named = name_launch(args, tensors, host_ints)
        if named is None:
            # Expected past the lookup-table batch, whose table the wrapper builds per call.
            log.info("flash-attn-4: calls of %d sequences, up to %d query tokens, keep the wrapper (%d launches, "
                     "not every argument one of the call's own)", seqused_k.shape[0], max_seqlen_q,
                     len(watched.launches))  # fmt: skip
            self._templates[key] = None
        else:
            self._templates[key] = LaunchTemplate(kernel, *named)
        return out


__all__ = ["VERIFIED_VERSIONS", "FA4Launcher", "LaunchTemplate", "fast_launch_supported", "launch_class", "name_launch"]
