"""Piecewise CUDA graphs of prefill and mixed steps: everything but attention, by token count.

flash-attn's varlen call takes the step's lengths as host integers, so a prefill or mixed step
cannot be one graph. The model is cut at each attention call: per token bucket, L + 1 pieces are
recorded over static buffers and attention runs eagerly between them on the real tokens. A step
pads to its bucket (padded rows write to the scratch block and are dropped). `capture=False`
keeps the pieces as plain calls, which is how the CPU tests check the cutting.
docs/engine-kernels.md, "Attention backends", and docs/engine.md, "Piecewise graphs: padding"."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdserve.engine.kernels.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.model.model import CausalLM, ForwardContext

log = logging.getLogger(__name__)


def step_buckets(max_tokens: int) -> list[int]:
    """Token counts a step pads up to: powers of two up to 256 (a step that short reads its
    weights whatever its rows, so padding costs little), then eight a doubling (a padded row
    costs as much as a real one once the matmuls are bound by their arithmetic: at most an
    eighth more rows, about 6 % on average; a quarter, as with 256 apart, made the 8B shape's
    prompt matmuls 1.2x vLLM's unpadded ones), and `max_tokens` itself, the largest."""
    buckets = [16, 32, 64, 128, 256]
    while buckets[-1] < max_tokens:
        n = buckets[-1]
        buckets.append(n + (1 << (n.bit_length() - 1)) // 8)
    return sorted({n for n in buckets if n < max_tokens} | {max_tokens})


class StepGraphs:
    """The recorded pieces of one runner, for every bucket, with the buffers they share."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: torch.Tensor,
        backend: AttentionBackend,
        buckets: list[int],
        scratch_block: int,
        capture: bool = True,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets: need token counts >= 1, got {buckets}")
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.buckets = sorted(set(buckets))
        self.max_tokens = self.buckets[-1]
        cfg = model.cfg
        dev, dtype, n = kv_pool.device, model.embed_tokens.weight.dtype, self.max_tokens
        # Rows: token ids, positions, slot block, slot offset. Padded rows hold `_pad`'s values.
        self._pad = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self._pad[2].fill_(scratch_block)
        self._inputs = self._pad.clone()
        self._residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self._q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self._o = torch.zeros(n, cfg.num_heads * cfg.head_dim, dtype=dtype, device=dev)
        self._hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self._pool = None
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        stream = torch.cuda.Stream(device=dev) if capture else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))
        for size in reversed(self.buckets):  # largest first: the shared pool is sized once
            calls = self._piece_calls(size)
            self.pieces[size] = calls if stream is None else self._record(calls, stream)
        if stream is not None:
            torch.cuda.synchronize(dev)
            log.info("captured piecewise CUDA graphs for prefill and mixed steps of up to %s tokens: %d buckets x %d pieces",
                     self.max_tokens, len(self.buckets), len(model.layers) + 1)

    # ----- capture -------------------------------------------------------------------------

    def _piece_calls(self, n: int) -> list[Callable[[], None]]:
        """The L + 1 pieces of a step of `n` tokens, as calls over views of the buffers."""
        model, layers, rotary = self.model, self.model.layers, self.model.rotary
        ids, positions = self._inputs[0, :n], self._inputs[1, :n]
        # Only the slots are read before attention; the rest is the eager attention's business.
        meta = AttentionMetadata(
            slot_block=self._inputs[2, :n], slot_offset=self._inputs[3, :n], cu_seqlens_q=ids[:0].int(),
            seq_lens=ids[:0].int(), block_tables=ids[:0].int().view(0, 0), max_query_len=0, max_seq_len=0,
            query_lens=[], seq_lens_host=[],
        )  # fmt: skip
        ctx = ForwardContext(meta, self.kv_pool, self.backend)
        residual, q, o, hidden = self._residual[:n], self._q[:n], self._o[:n], self._hidden[:n]

        def first() -> None:
            r = model.embed_tokens(ids)
            residual.copy_(r)
            q.copy_(layers[0].self_attn.project(layers[0].input_layernorm(r), positions, rotary, ctx))

        def between(i: int) -> Callable[[], None]:
            def piece() -> None:
                r, h = layers[i - 1].after_attention(residual, o, layers[i].input_layernorm)
                residual.copy_(r)
                q.copy_(layers[i].self_attn.project(h, positions, rotary, ctx))

            return piece

        def last() -> None:
            _, h = layers[-1].after_attention(residual, o, model.norm)
            hidden.copy_(h)

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def _record(self, calls: list[Callable[[], None]], stream: torch.cuda.Stream) -> list[Callable[[], None]]:
        # Warm up first on the same stream: Triton and compiled kernels built, cuBLAS's
        # per-stream workspace made, before anything is recorded.
        with torch.cuda.stream(stream):
            for _ in range(2):
                for call in calls:
                    call()
        torch.cuda.synchronize(stream.device)
        replays = []
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                call()
            if self._pool is None:
                self._pool = graph.pool()
            replays.append(graph.replay)
        return replays

    # ----- replay --------------------------------------------------------------------------

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def forward(self, token_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's final hidden states [T, hidden] for a step whose inputs are `token_rows`
        [4, T] (token ids, positions, slot blocks, slot offsets) and whose attention metadata
        is `meta`. The result is a view of a buffer the next step overwrites."""
        t = token_rows.shape[1]
        n = self.bucket_for(t)
        self._inputs[:, :t].copy_(token_rows)
        if n > t:
            self._inputs[:, t:n].copy_(self._pad[:, t:n])
        pieces = self.pieces[n]
        ctx = ForwardContext(meta, self.kv_pool, self.backend)
        q, o = self._q[:t], self._o[:t]
        for i, layer in enumerate(self.model.layers):
            pieces[i]()
            o.copy_(layer.self_attn.attend(q, ctx))
        pieces[-1]()
        return self._hidden[:t]


@torch.inference_mode()
def capture_step_graphs(
    model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend, max_tokens: int, scratch_block: int
) -> StepGraphs:
    if kv_pool.device.index is not None:
        torch.cuda.set_device(kv_pool.device)
    return StepGraphs(model, kv_pool, backend, step_buckets(max_tokens), scratch_block)
