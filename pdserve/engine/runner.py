"""Runs scheduled batches on the device: owns the model, the KV pool and the CUDA graphs.

Input preparation, the forward pass, sampling, and steps launched without waiting for them;
`cuda_graphs` captures and replays the graphs. The KV pool is one block-major tensor
``[num_blocks + 1, num_layers, 2, block_size, kv_heads, head_dim]``, so a run of consecutive
blocks is one contiguous region for a transfer; the extra last block is scratch for padded
graph rows. docs/engine.md, "KV pool layout, and why"."""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_decode_graphs, decode_kernels_for
from pdserve.engine.grammar import GrammarMasks
from pdserve.engine.kernels.backends import make_backend
from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention, mixed_step_backend
from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.model.model import CausalLM, ForwardContext, layer_caches
from pdserve.engine.penalty_slots import PenaltySlots
from pdserve.engine.prompt_logprobs import score_step
from pdserve.engine.sampler import draw, sample
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.step_graphs import StepGraphs, capture_step_graphs
from pdserve.engine.step_inputs import StepInputs, build_step_inputs, to_device

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledToken:
    """One row's draw: the token, and its logprob and top logprobs where the request asked.
    (Not frozen: one is built for every row of every step, and a frozen dataclass's init costs
    three times as much.)"""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class DecodeLaunch:
    """A step launched on the device and not yet waited for."""

    tokens: torch.Tensor  # on the device: the step's draws, one per sampled row
    host_tokens: torch.Tensor  # pinned host mirror they are copied to
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU: already done)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor in anonymous mapped memory, which reads as zeros and takes
    physical pages only where written: a KV pool sized for many long sequences then costs the
    memory of the blocks in use, not of the whole pool (torch.zeros writes every page)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def scores_prompts(inputs: StepInputs, scheduled: list[ScheduledSeq]) -> bool:
    """Whether a step (not launched behind another) may score prompt tokens (`prompt_logprobs`):
    it has prompt rows; a decode-only step scores nothing."""
    return inputs.meta.max_query_len > 1 or len(inputs.sampled) < len(scheduled)


def pending_rows(scheduled: list[ScheduledSeq], feed: list[tuple[int, int]] | tuple) -> dict[int, int]:
    """Sampled row j -> k for each sampled row whose input is the k-th draw of the step still
    in flight (`feed` names input rows; a row's input is its last token)."""
    row_end, sampled_at, at = {}, 0, 0
    for item in scheduled:
        at += item.num_new_tokens
        if item.sample:
            row_end[at - 1] = sampled_at
            sampled_at += 1
    return {row_end[r]: k for r, k in feed}


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        mc = model.shard_cfg  # this rank's KV heads (all of them in a single-process engine)
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, mc.num_layers, 2, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":
            self.kv_pool = zeroed_host_tensor(shape, cfg.dtype)
        else:
            self.kv_pool = torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        self._layer_caches = layer_caches(self.kv_pool)
        self.backend = make_backend(cfg.attention_backend, self.device, cfg.dtype)
        # Steps that do not replay a decode graph attend through this one: `backend`, or on CUDA
        # `backend` with the decodes of mixed steps split off to the Triton decode kernel.
        wanted = cfg.mixed_decode_attention
        # By default it follows the Triton decode kernels: turning those off turns it off too.
        load = wanted or (wanted is None and cfg.triton_decode_kernels is not False)
        kernels = decode_kernels_for(mc.head_dim, None) if self.device.type == "cuda" and load else None
        self.step_backend = mixed_step_backend(self.backend, self.device, kernels, wanted)
        self.default_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs where they are on
        self.grammar: GrammarMasks | None = None  # structured output's masks; the engine sets it
        self.step_graphs: StepGraphs | None = None  # prefill and mixed steps, likewise
        on_device = cfg.penalties_on_device
        self._slots_wanted = on_device if on_device is not None else self.device.type == "cuda"
        self._penalty_slots: PenaltySlots | None = None  # made on the first penalized row
        pin = self.device.type == "cuda"
        self._token_mirrors = [torch.zeros(cfg.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_turn = 0
        # Feed indices (input row, draw) of a step launched behind another: staged through
        # pinned buffers made once, since allocating pinned memory mid-loop can stall the host.
        self._feed_mirrors = [torch.zeros(2 * cfg.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._feed_turn = 0
        log.info("attention backend %s", self.step_backend.name)

    # ----- inputs --------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledSeq], ahead: int | list[int] = 0) -> StepInputs:
        """The step's inputs on the device (`step_inputs.build_step_inputs`)."""
        return build_step_inputs(scheduled, ahead, self.block_size, self.device)

    # ----- execution -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], eos_token_ids: Collection[int] = ()
    ) -> dict[str, SampledToken]:
        """Run one step; returns request id -> its sampled token (with logprobs where asked).
        `eos_token_ids`: what min_tokens holds back."""
        sampled, logits, argmax = self._forward(scheduled)
        if not sampled:
            return {}
        # Structured output: tokens a row's grammar forbids go to -inf before any draw or argmax.
        if self.grammar is not None and self.grammar.mask(logits, sampled):
            argmax = None  # a decode graph's argmax saw the logits unmasked
        params = [s.seq.params for s in sampled]
        if argmax is not None and all(p.greedy and not p.logprobs and not p.processes_logits for p in params):
            return {s.seq.request_id: SampledToken(t) for s, t in zip(sampled, argmax.tolist())}
        gens = [self._generator_for(s) for s in sampled]
        rows = None
        if any(p.processes_logits for p in params):
            rows = [
                RowTokens(
                    s.seq.token_array(),
                    s.seq.params.output_offset + s.seq.num_output_tokens,
                    cache=s.seq.penalty_tokens,
                    owner=s.seq,
                )
                for s in sampled
            ]
        out = sample(logits, params, gens, self.default_generator, rows, tuple(eos_token_ids), self._slots(logits))
        return {
            s.seq.request_id: SampledToken(
                out.tokens[i],
                None if out.logprobs is None else out.logprobs[i],
                None if out.top_logprobs is None else out.top_logprobs[i],
            )
            for i, s in enumerate(sampled)
        }

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledSeq],
        ahead: int | list[int] = 0,
        previous: DecodeLaunch | None = None,
        feed: list[tuple[int, int]] | tuple = (),
        eos_token_ids: Collection[int] = (),
    ) -> DecodeLaunch:
        """Start a step whose sampled tokens stay on the device, and return without waiting for
        it: decode rows, prompt chunks, or both; greedy and random rows, with or without a
        grammar (no logprobs: `overlap_plan`). The host never waits between two such steps, so it
        does the bookkeeping of one while the device runs the next; only a grammar row fed the
        step before's draw waits for that draw, while this step's forward runs.

        Behind `previous` (the step still running): row i starts `ahead[i]` positions past its
        computed tokens, and each (row, k) of `feed` takes as its input token the k-th draw of
        `previous`, on the device. Rows with logit bias, min_tokens or penalties are processed
        first, and a seeded row draws as its next output token, a fed row's draw counting as its
        last output token (`eos_token_ids`: what min_tokens holds back)."""
        sampled, logits, argmax = self._forward(scheduled, ahead, previous, feed)
        pending = pending_rows(scheduled, feed) if previous is not None else {}
        params = [item.seq.params for item in sampled]
        if logits is not None and self.grammar is not None and any(p.structured_output for p in params):
            # A grammar row's mask needs the draw in flight on the host: wait for the step before
            # (this one's forward is queued behind it already), then fill while this one runs.
            drawn = self.collect(previous) if previous is not None and pending else []
            if self.grammar.mask(logits, sampled, {j: drawn[k] for j, k in pending.items()}):
                argmax = None
        if logits is not None and any(p.processes_logits for p in params):
            logits = self._process(sampled, logits, previous, pending, tuple(eos_token_ids))
            argmax = None
        if logits is not None and not all(p.greedy for p in params):
            gens = [self._generator_for(s, int(j in pending)) for j, s in enumerate(sampled)]
            tokens = draw(logits, params, gens, self.default_generator)
        elif argmax is not None:
            tokens = argmax
        elif logits is not None:
            tokens = logits.argmax(dim=-1)
        else:  # prompt chunks only: nothing sampled
            tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        host = self._token_mirrors[self._token_turn][: tokens.shape[0]]
        self._token_turn ^= 1  # the previous step's mirror may not have been read yet
        host.copy_(tokens, non_blocking=self.device.type == "cuda")
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        return DecodeLaunch(tokens, host, done)

    def _forward(
        self,
        scheduled: list[ScheduledSeq],
        ahead: int | list[int] = 0,
        previous: DecodeLaunch | None = None,
        feed: list[tuple[int, int]] | tuple = (),
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None, torch.Tensor | None]:
        """Run the model for a step: (the items that sample, their logits, their greedy tokens
        when the decode graph computed them). `ahead`, `previous`, `feed`: see `launch`."""
        if self.device.type == "cuda" and self.device.index is not None:
            # Engine loops run on their own threads, whose current device is not ours by default.
            # (A bare "cuda" has no index: torch.cuda.set_device rejects it; nothing to set then.)
            torch.cuda.set_device(self.device)

        def fed(input_ids: torch.Tensor) -> None:
            if previous is not None and feed:
                self._feed(input_ids, previous.tokens, feed)

        if self.graphs is not None and self.graphs.fits(scheduled):
            # Decode-only: every row samples, and the graph already holds logits and argmax.
            logits, argmax = self._replay_decode_graph(scheduled, ahead, fed)
            return scheduled, logits, argmax
        inputs = self.prepare(scheduled, ahead)
        fed(inputs.input_ids)
        if self.step_graphs is not None and self.step_graphs.fits(inputs.input_ids.shape[0]):
            hidden = self.step_graphs.forward(inputs.token_rows, inputs.meta)
        else:
            ctx = ForwardContext(inputs.meta, self.kv_pool, self.step_backend, layer_caches=self._layer_caches)
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if previous is None and scores_prompts(inputs, scheduled):
            score_step(scheduled, inputs.meta.query_lens, hidden, self.model.compute_logits)
        if not inputs.sampled:
            return [], None, None
        return inputs.sampled, self.model.compute_logits(hidden[inputs.logits_indices]), None

    def _replay_decode_graph(
        self, scheduled: list[ScheduledSeq], ahead: int | list[int], fed: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.graphs is not None
        return self.graphs.replay(scheduled, ahead, fed)

    def _process(
        self,
        sampled: list[ScheduledSeq],
        logits: torch.Tensor,
        previous: DecodeLaunch | None,
        pending_rows: dict[int, int],
        eos_token_ids: tuple[int, ...],
    ) -> torch.Tensor:
        """`process_logits` for a launched step: a fed row's input token, still on the device,
        is its pending output token."""
        rows = [
            RowTokens(
                s.seq.token_array(),
                s.seq.params.output_offset + s.seq.num_output_tokens,
                int(j in pending_rows),
                s.seq.penalty_tokens,
                s.seq,
            )
            for j, s in enumerate(sampled)
        ]
        pending = None
        if pending_rows and previous is not None:
            pending = torch.full((len(sampled),), logits.shape[-1], dtype=torch.int64, device=logits.device)
            index = to_device(np.asarray(list(pending_rows.items()), dtype=np.int64).T.copy(), self.device)
            pending.index_copy_(0, index[0], previous.tokens.index_select(0, index[1]))
        # In place: a launched step reads only the processed logits (its draw).
        params = [s.seq.params for s in sampled]
        return process_logits(logits, params, rows, eos_token_ids, pending, inplace=True, slots=self._slots(logits))

    def _slots(self, logits: torch.Tensor) -> PenaltySlots | None:
        """The penalties' device state where it is on (`EngineConfig.penalties_on_device`)."""
        if self._slots_wanted and self._penalty_slots is None:
            self._penalty_slots = PenaltySlots(logits.shape[-1], logits.device)
        return self._penalty_slots

    def _feed(self, input_ids: torch.Tensor, tokens: torch.Tensor, feed: list[tuple[int, int]] | tuple) -> None:
        """input_ids[row] = tokens[k] for each (row, k) of `feed`, on the device."""
        n = len(feed)
        if n == tokens.shape[0] and all(r == i and k == i for i, (r, k) in enumerate(feed)):
            input_ids[:n].copy_(tokens)  # a decode step behind one of the same rows
            return
        host = self._feed_mirrors[self._feed_turn][: 2 * n].view(2, n)  # contiguous: copied as it is
        self._feed_turn ^= 1  # the other one may still feed the step in flight
        host.numpy()[:] = np.asarray(feed, dtype=np.int64).T
        index = host.to(self.device, non_blocking=self.device.type == "cuda")
        input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

    def collect(self, launch: DecodeLaunch) -> list[int]:
        """Wait for a launched step and return its tokens."""
        if launch.done is not None:
            launch.done.synchronize()
        return launch.host_tokens.tolist()

    def wait_device(self) -> None:
        """Wait until the device has run everything launched, e.g. before another engine
        (a KV transfer) writes blocks that a launched step might still write."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generator_for(self, item: ScheduledSeq, pending: int = 0) -> torch.Generator | None:
        """A seeded request draws its i-th token from a generator seeded with (seed, i): the
        draw depends on neither the batch, a preemption, nor which worker samples it. `pending`:
        its draws still on the device (a step launched behind the one drawing its input)."""
        seq = item.seq
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
        index = seq.params.output_offset + seq.num_output_tokens + pending
        seq.generator.manual_seed(_mix_seed(seq.params.seed, index))
        return seq.generator

    # ----- CUDA graphs for decode steps ----------------------------------------------------

    def capture_cuda_graphs(self) -> None:
        """Record the decode forward where CUDA graphs are on (see `cuda_graphs`), and the
        prefill and mixed steps' pieces around attention (see `step_graphs`). The eager attention
        kernel, and where mixed steps split their decodes off the decode kernel, are compiled
        here too, so no step in serving waits for a compile."""
        self.warm_up_attention()
        self.record_graphs()

    def warm_up_attention(self) -> None:
        """Compile the eager attention kernels (`capture_cuda_graphs`)."""
        k_cache, v_cache = self._layer_caches[0]
        warm_eager = getattr(self.backend, "warm_up", None)
        if warm_eager is not None:
            heads = self.model.shard_cfg.num_heads  # this rank's query heads (all of them at width 1)
            warm_eager(k_cache, v_cache, heads, self.scratch_block, self.cfg.max_num_seqs, self.max_model_len)
        if isinstance(self.step_backend, MixedDecodeAttention):
            self.step_backend.warm_up(k_cache, v_cache, self.model.shard_cfg.num_heads, self.cfg.max_num_seqs)

    def record_graphs(self) -> None:
        """Record the decode graphs and the piecewise step graphs (`capture_cuda_graphs`)."""
        self.graphs = capture_decode_graphs(
            self.model, self.kv_pool, self.backend, self.cfg, self.max_model_len, self.scratch_block
        )
        if self.graphs is not None and self.cfg.prefill_cuda_graphs is not False:
            self.step_graphs = capture_step_graphs(
                self.model, self.kv_pool, self.step_backend, self.cfg.max_num_batched_tokens, self.scratch_block
            )

    @property
    def has_decode_graphs(self) -> bool:
        return self.graphs is not None

    @property
    def overlaps_by_default(self) -> bool:
        """Whether decode steps overlap where `overlap_decode` is left unset: where they are
        graphs, the only place the host's time shows."""
        return self.graphs is not None

    @property
    def decode_kernel_graphs(self) -> dict[int, str]:
        """Captured batch size -> the Triton decode kernels its graph runs."""
        return {} if self.graphs is None else self.graphs.kernel_graphs


def _mix_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)

