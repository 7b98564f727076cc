"""The engine: admit requests, schedule, run the model, turn tokens into outputs.

`LLMEngine.step` runs one step (decode steps overlapped with the host's bookkeeping where CUDA
graphs are on); the KV hand-over hooks that prefill and decode workers call are thin methods
over `handover`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pdserve.engine import handover
from pdserve.engine.block_manager import BlockManager, BlockStats
from pdserve.engine.config import EngineConfig, ModelConfig, Role
from pdserve.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from pdserve.engine.handover import ImportPlan, PinnedKv, check_block_hashes
from pdserve.engine.kv_sizing import cpu_kv_blocks, cuda_kv_blocks, step_activation_bytes
from pdserve.engine.model.cpu_linear import onednn_available
from pdserve.engine.model.model import CausalLM
from pdserve.engine.model.weights import init_dummy_weights, load_weights
from pdserve.engine.runner import DecodeLaunch, ModelRunner, kv_block_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerLimits
from pdserve.engine.sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"; None while running or when only prefilled
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # generated in this step
    new_text: str = ""  # text that became final in this step


@dataclass(frozen=True)
class _InFlight:
    """A greedy decode step running on the device, its outputs not yet taken."""

    scheduled: list[ScheduledSeq]
    launch: DecodeLaunch


class LLMEngine:
    """One model on one device, stepped: `add_request`, `step`, `abort`, and the P/D hand-over
    (`pinned_kv`, `begin_import`, `commit_import`, `release`). Every worker and the offline `LLM`
    run one; it takes no lock of its own (workers share it through `EngineLoop`'s lock)."""

    def __init__(self, cfg: EngineConfig) -> None:
        model_dir = Path(cfg.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_dir)
        device = torch.device(cfg.device)
        model = CausalLM.empty(mc, self.max_model_len, device, cfg.dtype)
        if cfg.load_format == "dummy":
            init_dummy_weights(model, cfg.seed)
        else:
            load_weights(model, model_dir)
        model.eval()
        if cfg.cpu_packed_weights is not False and onednn_available(device, cfg.dtype):
            log.info("packed %d weight matrices for oneDNN", model.pack_for_cpu())
        elif cfg.cpu_packed_weights:
            raise ValueError(f"cpu_packed_weights: oneDNN's packed linear is not available for {device.type}/{cfg.dtype}")
        if cfg.compile_elementwise or (cfg.compile_elementwise is None and device.type == "cuda"):
            model.ops.compile()
        num_blocks = cfg.num_kv_blocks or self._blocks_from_memory(mc, device)
        per_block = kv_block_bytes(mc, cfg.block_size, cfg.dtype)
        log.info(
            "KV pool: %d blocks of %d tokens, %.1f MiB (%s; %.1f sequences of %d tokens)",
            num_blocks,
            cfg.block_size,
            num_blocks * per_block / 2**20,
            "num_kv_blocks" if cfg.num_kv_blocks else f"sized from {device.type} memory",
            num_blocks * cfg.block_size / self.max_model_len,
            self.max_model_len,
        )
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.runner = ModelRunner(model, cfg, num_blocks, self.max_model_len)
        self.runner.capture_cuda_graphs()
        eos = set(mc.eos_token_ids)
        gen_cfg_eos = _generation_config_eos(model_dir)
        eos.update(gen_cfg_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        limits = SchedulerLimits(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.role)
        self.scheduler = Scheduler(limits, self.blocks, self.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        # Overlapped decode: step n+1 is launched before step n's tokens are read back (see step).
        self._overlap = cfg.role != "prefill" and (
            cfg.overlap_decode if cfg.overlap_decode is not None else self.runner.has_decode_graphs
        )
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous one's tokens were read
        # Rows of the step whose tokens the last `step()` call read back (both 0: it read none).
        self.last_step_decodes = 0
        self.last_step_prefills = 0

    # ----- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt token ids instead")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return list(self.tokenizer.encode(prompt))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: token {t!r} at index {i} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate in the model's context of {self.max_model_len} tokens"
            )
        if self.blocks.blocks_needed(n + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt: {n} tokens need more KV blocks than the whole pool holds ({self.blocks.num_blocks})"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: expected a SamplingParams")

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        self.validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        seq = Sequence(rid, list(prompt_token_ids), params, next(self._arrivals))
        self._seqs[rid] = seq
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer if self.cfg.detokenize else None, params.stop)
        self.scheduler.add(seq)
        return rid

    # ----- KV hand-over between workers ------------------------------------------------------

    def pinned_kv(self, request_id: str) -> PinnedKv:
        """Prefill role: where a finished request's KV sits, for building a transfer handle."""
        return handover.pinned_kv(self.scheduler, request_id, self.cfg.block_size)

    def final_prompt_blocks(self, request_id: str) -> list[int] | None:
        """Prefill role: the prompt's blocks whose KV is already final, in prompt order (see
        `handover.final_prompt_blocks`); None when the engine does not hold the request."""
        return handover.final_prompt_blocks(self.scheduler, request_id, self.cfg.block_size)

    def lend_blocks(self, block_ids: list[int]) -> None:
        """Take a reference on blocks another worker is reading, so that neither a preemption
        nor an abort of their request frees them for reuse before `return_blocks`."""
        self.blocks.acquire(block_ids)

    def return_blocks(self, block_ids: list[int]) -> None:
        self.blocks.release(block_ids)

    def begin_import(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, block_hashes: list[int]
    ) -> ImportPlan:
        """Decode role: allocate blocks for a request whose prompt KV was computed elsewhere.
        Blocks already in this engine's prefix cache are reused; the plan lists the rest."""
        self.validate(prompt_token_ids, params)
        if request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), params, next(self._arrivals))
        check_block_hashes(seq, block_hashes, self.cfg.block_size)
        if self._inflight is not None:
            # The READ that fills these blocks is not ordered with the device's stream: a block
            # just freed by a finished request may still be written by the step in flight.
            self.runner.wait_device()
        plan = handover.begin_import(self.scheduler, seq)  # raises NoFreeBlocksError when full
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer if self.cfg.detokenize else None, params.stop)
        return plan

    def commit_import(self, request_id: str, first_token: int) -> None:
        seq = self._seqs[request_id]
        self._detok[request_id].add([first_token])
        self.scheduler.commit_import(seq, first_token)
        if seq.status is SeqStatus.FINISHED:
            del self._seqs[request_id]
            del self._detok[request_id]

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def release(self, request_id: str) -> bool:
        """Prefill role: free a finished request's pinned KV blocks (after its transfer) and
        forget the request."""
        if not self.scheduler.release_pinned(request_id):
            return False
        self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        return True

    def cached_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        """Prompt tokens that admission would serve from this engine's prefix cache now."""
        return handover.cached_prompt_tokens(self.blocks, prompt_token_ids, self.cfg.block_size)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def holds_requests(self) -> int:
        """Requests this engine still holds in any state: running, waiting, pinned for a
        transfer, or being imported. Zero: nothing but the prefix cache is in its KV pool."""
        s = self.scheduler
        return len(s.running) + len(s.ready) + len(s.waiting) + len(s.pinned) + len(s.importing) + (self._inflight is not None)

    def switch_role(self, role: Role) -> None:
        """Serve the other pool from now on (a P:D role flip), keeping the weights, the KV pool
        and its prefix cache: only what the role decides changes (the scheduler's handling of a
        finished prefill, overlapped decode, detokenizing). The engine must hold no request."""
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"role: must be prefill, decode or both, not {role!r}")
        held = self.holds_requests()
        if held:
            raise RuntimeError(f"switch_role: the engine still holds {held} requests; drain it first")
        self.cfg = replace(self.cfg, role=role, detokenize=role != "decode")
        self.scheduler.limits = replace(self.scheduler.limits, role=role)
        self._overlap = role != "prefill" and (
            self.cfg.overlap_decode if self.cfg.overlap_decode is not None else self.runner.has_decode_graphs
        )

    # ----- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced.

        Overlapped decode (on with CUDA graphs): while every running sequence decodes greedily
        and nothing waits, step n+1 is launched with step n's tokens as its inputs, on the
        device, before step n's tokens are read back; the host's bookkeeping for step n then
        runs while the device computes step n+1. A sequence that stops at step n had one more
        token computed in step n+1; it is dropped. Outputs of a launched step come with the
        next call."""
        if self._inflight is not None:
            return self._step_overlapped(self._inflight)
        self.last_step_decodes = self.last_step_prefills = 0
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        if self._overlap and self._overlappable(scheduled):
            self._inflight = _InFlight(scheduled, self.runner.launch_greedy_decode(scheduled))
            return []
        sampled = self.runner.execute(scheduled)
        # A decode row computes one token past its prompt; a row still in its prompt is prefill.
        decodes = sum(
            1 for item in scheduled if item.num_new_tokens == 1 and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
        )
        self.last_step_decodes, self.last_step_prefills = decodes, len(scheduled) - decodes
        return self._finish_step(scheduled, sampled)

    def _overlappable(self, scheduled: list[ScheduledSeq]) -> bool:
        return all(
            item.num_new_tokens == 1 and item.sample and item.seq.params.greedy and not item.seq.params.logprobs
            for item in scheduled
        )

    def _step_overlapped(self, current: _InFlight) -> list[RequestOutput]:
        following = self._plan_following(current.scheduled)
        launch = None
        if following:
            launch = self.runner.launch_greedy_decode(following, current.launch)
            self.num_overlapped_steps += 1
        tokens = self.runner.collect(current.launch)
        self.last_step_decodes, self.last_step_prefills = len(current.scheduled), 0
        # Aborted while in flight: its token is dropped (its blocks were freed in stream order).
        live = [(item, t) for item, t in zip(current.scheduled, tokens) if item.seq.status is SeqStatus.RUNNING]
        outputs = self._finish_step([item for item, _ in live], {item.seq.request_id: (t, None) for item, t in live})
        self._inflight = _InFlight(following, launch) if following and launch is not None else None
        return outputs

    def _plan_following(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """The step after `scheduled` (same sequences, one token further), or None when it
        cannot be launched blind: requests are waiting, the running set changed, a sequence
        is sure to stop at `scheduled` (length), or a KV block is missing."""
        sched = self.scheduler
        if sched.waiting or sched.ready or len(sched.running) != len(scheduled):
            return None
        if any(a is not item.seq for a, item in zip(sched.running, scheduled)):
            return None
        for item in scheduled:
            seq = item.seq
            # After `scheduled`: num_tokens + 1 tokens, of which num_output_tokens + 1 generated.
            if seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len:
                return None
        for item in scheduled:
            if not sched.reserve(item.seq, item.seq.num_computed_tokens + 2):
                return None  # blocks taken so far stay with their sequences: the next step uses them
        return [ScheduledSeq(item.seq, 1, True) for item in scheduled]

    def _finish_step(
        self, scheduled: list[ScheduledSeq], sampled: dict[str, tuple[int, float | None]]
    ) -> list[RequestOutput]:
        tokens = {rid: tok for rid, (tok, _) in sampled.items()}
        produced = self.scheduler.update(scheduled, tokens)
        outputs: list[RequestOutput] = []
        for seq in produced:
            rid = seq.request_id
            token, logprob = sampled[rid]
            if seq.params.logprobs and logprob is not None:
                seq.logprobs.append(logprob)
            detok = self._detok[rid]
            matched = detok.add([token])
            if matched is not None and seq.status is SeqStatus.PINNED:
                # Prefill role: the KV stays pinned for its hand-over; the stop is the answer's end.
                seq.finish_reason = "stop"
            elif matched is not None and seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "stop")
            finished = seq.status in (SeqStatus.FINISHED, SeqStatus.PINNED)
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=seq.prompt_token_ids,
                    token_ids=seq.output_token_ids,
                    text=detok.text,
                    finished=finished,
                    finish_reason=seq.finish_reason,
                    num_cached_tokens=seq.num_cached_tokens,
                    logprobs=list(seq.logprobs) if seq.params.logprobs else None,
                    new_token_ids=[token],
                    new_text=detok.stream_delta(finished),
                )
            )
            if seq.status is SeqStatus.FINISHED:
                del self._seqs[rid]
                del self._detok[rid]
        return outputs

    # ----- introspection -------------------------------------------------------------------

    def block_stats(self) -> BlockStats:
        return self.blocks.stats()

    def load_stats(self) -> dict[str, int]:
        """KV pool and queue figures under the names workers report them with."""
        b = self.block_stats()
        s = self.scheduler
        return {
            "kv_blocks_total": b.total,
            "kv_blocks_free": b.free,
            "kv_blocks_cached": b.cached,
            "kv_blocks_in_use": b.in_use,
            "running_requests": len(s.running),
            "waiting_requests": len(s.waiting) + len(s.ready),  # ready: imported, waiting for a place
            "pinned_requests": len(s.pinned),
            "preemptions": s.num_preemptions,
        }

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ----- sizing --------------------------------------------------------------------------

    def _blocks_from_memory(self, mc: ModelConfig, device: torch.device) -> int:
        cfg = self.cfg
        per_block = kv_block_bytes(mc, cfg.block_size, cfg.dtype)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            dtype_bytes = torch.finfo(cfg.dtype).bits // 8
            activations = step_activation_bytes(mc, cfg.max_num_batched_tokens, cfg.max_num_seqs, dtype_bytes)
            return cuda_kv_blocks(
                per_block, self.max_model_len, cfg.block_size, cfg.max_num_seqs,
                free, total, cfg.memory_utilization, activations,
            )
        return cpu_kv_blocks(
            per_block, self.max_model_len, cfg.block_size, cfg.max_num_seqs,
            host_available_bytes(), cfg.workers_on_host, cfg.cpu_kv_cache_bytes,
        )


def host_available_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (free plus reclaimable cache),
    bounded by this process's cgroup limit where one is set."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return []
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
