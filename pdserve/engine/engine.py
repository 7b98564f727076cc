"""The engine: admit requests, schedule, run the model, turn tokens into outputs.

`LLMEngine.step` runs one step (decode steps overlapped with the host's bookkeeping where CUDA
graphs are on); the KV hand-over hooks that prefill and decode workers call are thin methods
over `handover`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.engine import handover
from pdserve.engine.block_manager import BlockManager, BlockStats
from pdserve.engine.config import EngineConfig, ModelConfig, Role, worker_detokenizes
from pdserve.engine.detokenizer import load_tokenizer
from pdserve.engine.grammar import GrammarMasks
from pdserve.engine.handover import ImportPlan, PinnedKv, check_block_hashes
from pdserve.engine.model_loading import eos_token_ids
from pdserve.engine.overlap_plan import overlappable, plan_following
from pdserve.engine.parallel.tp_runner import start_runner
from pdserve.engine.request_table import RequestTable
from pdserve.engine.runner import DecodeLaunch, SampledToken
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerLimits
from pdserve.engine.sequence import SeqStatus
from pdserve.engine.step_outputs import RequestOutput, step_outputs
from pdserve.engine.step_slack import StepSlack


@dataclass(frozen=True)
class _InFlight:
    """A greedy step (decode, prompt or mixed) running on the device, its outputs not yet taken."""

    scheduled: list[ScheduledSeq]
    launch: DecodeLaunch
    chained: bool  # launched while the step before it ran: the device went on without a gap


class LLMEngine:
    """One model on one device, stepped: `add_request`, `step`, `abort`, and the P/D hand-over
    (`pinned_kv`, `begin_import`, `commit_import`, `release`) over the requests in its table. Every
    worker and the offline `LLM` run one; it takes no lock (workers share `EngineLoop`'s)."""

    def __init__(self, cfg: EngineConfig) -> None:
        model_dir = Path(cfg.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_dir)
        # The model and its KV pool (with tensor_parallel_size > 1, rank 0 of the ranks it starts).
        self.runner = start_runner(cfg, mc, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.runner.capture_cuda_graphs()
        self.eos_token_ids = eos_token_ids(mc, model_dir, self.tokenizer)
        # Structured output: the runner masks grammar rows' logits; requests are checked here first.
        self.grammar = self.runner.grammar = GrammarMasks(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        limits = SchedulerLimits(
            cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.role,
            cfg.max_prefill_tokens_with_decodes,
        )
        self.scheduler = Scheduler(limits, self.blocks, self.eos_token_ids)
        if cfg.itl_target_ms is not None:
            self.scheduler.slack = StepSlack(cfg.itl_target_ms / 1e3)
        # Prompt tokens a second the steps could carry beside the batch of the last one, within
        # the target (`StepSlack.prompt_tokens_per_s`), for a decode worker's router; written by
        # the stepping thread only. None: no target, nothing measured, or no decode rows.
        self.prompt_tokens_per_s: float | None = None
        self._collected_at: float | None = None  # when the last overlapped step's tokens came back
        self.requests = RequestTable(self.tokenizer, mc.vocab_size, self.max_model_len, self.blocks)
        # Overlapped decode: step n+1 is launched before step n's tokens are read back (see step).
        self._overlap = self._overlaps(cfg.role)
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous one's tokens were read
        # Rows of the step whose tokens the last `step()` call read back (both 0: it read none),
        # and the prompt tokens it carried.
        self.last_step_decodes = 0
        self.last_step_prefills = 0
        self.last_step_prompt_tokens = 0

    # ----- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.requests.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served."""
        self.requests.validate(prompt_token_ids, params)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        seq = self.requests.new_sequence(prompt_token_ids, params, request_id)
        self.grammar.check(params.structured_output)  # compiled before admission: a bad one is refused here
        self.requests.hold(seq, self.cfg.detokenize)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        seq = self.requests.forget(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

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

    def prepare(self, params: SamplingParams) -> None:
        """What admitting a request with `params` needs and no engine state: its grammar,
        compiled (ValueError naming the field where it cannot be). Callable from any thread
        without the lock that guards `add_request` and `begin_import`, which then find it."""
        self.grammar.check(params.structured_output)

    def begin_import(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, block_hashes: list[int]
    ) -> ImportPlan:
        """Decode role: allocate blocks for a request whose prompt KV was computed elsewhere.
        Blocks already in this engine's prefix cache are reused; the plan lists the rest."""
        seq = self.requests.new_sequence(prompt_token_ids, params, request_id)
        seq.prompt_logprobs = None  # computed where the prompt was, and sent from there
        check_block_hashes(seq, block_hashes, self.cfg.block_size)
        self.grammar.check(params.structured_output)  # structured output: compiled before blocks are taken
        plan = handover.begin_import(self.scheduler, seq)  # raises NoFreeBlocksError when full
        self.requests.hold(seq, self.cfg.detokenize)
        if self._inflight is not None:
            # The transfer waits for the step in flight (`ImportPlan.wait_writable`), not the
            # caller under the engine's lock: that wait stalled the loop once per hand-over.
            plan = replace(plan, device_ready=self._inflight.launch.done)
        return plan

    def commit_import(self, request_id: str, first_token: int) -> None:
        seq = self.requests.seqs[request_id]
        self.requests.detok[request_id].add([first_token])
        self.scheduler.commit_import(seq, first_token)
        if seq.status is SeqStatus.FINISHED:
            self.requests.forget(request_id)

    def release(self, request_id: str) -> bool:
        """Prefill role: free a finished request's pinned KV blocks (after its transfer) and
        forget the request."""
        if not self.scheduler.release_pinned(request_id):
            return False
        self.requests.forget(request_id)
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
        self.cfg = replace(self.cfg, role=role, detokenize=worker_detokenizes(role))
        self.scheduler.limits = replace(self.scheduler.limits, role=role)
        self._overlap = self._overlaps(role)

    def _overlaps(self, role: Role) -> bool:
        if role == "prefill":
            return False
        return self.cfg.overlap_decode if self.cfg.overlap_decode is not None else self.runner.overlaps_by_default

    # ----- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced.

        Overlapped steps (on with CUDA graphs): while no row that samples asks for logprobs,
        step n+1 is planned and launched before step n's tokens are read back, its
        sampled rows fed step n's tokens on the device (`overlap_plan`); the host's bookkeeping
        for step n then runs while the device computes step n+1. Decode, prompt and mixed steps
        alike. A sequence that stops at step n had one more token computed in step n+1; it is
        dropped. Outputs of a launched step come with the next call."""
        if self._inflight is not None:
            return self._step_overlapped(self._inflight)
        self.last_step_decodes = self.last_step_prefills = 0
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self._planned(scheduled)
        if self._overlap and overlappable(scheduled):
            launch = self.runner.launch(scheduled, eos_token_ids=self.eos_token_ids)
            self._inflight = _InFlight(scheduled, launch, chained=False)
            return []
        began = time.perf_counter()
        sampled = self.runner.execute(scheduled, self.eos_token_ids)
        self._count_rows(scheduled)
        self._observe(time.perf_counter() - began)
        return self._finish_step(scheduled, sampled)

    def _count_rows(self, scheduled: list[ScheduledSeq]) -> None:
        decodes, prompt_tokens = _rows(scheduled)
        self.last_step_decodes, self.last_step_prefills = decodes, len(scheduled) - decodes
        self.last_step_prompt_tokens = prompt_tokens

    def _planned(self, scheduled: list[ScheduledSeq], ahead: list[int] | None = None) -> None:
        """Tell the measured slack what a step about to launch carries (`ahead`: tokens of each
        row still in flight in the step before it)."""
        if self.scheduler.slack is not None:
            self.scheduler.slack.took(*_rows(scheduled, ahead))

    def _observe(self, seconds: float) -> None:
        """The step just read back took `seconds` of the running sequences' inter-token time."""
        slack = self.scheduler.slack
        if slack is not None:
            slack.observe(self.last_step_decodes, self.last_step_prompt_tokens, seconds)
            cap = self.scheduler.limits.max_prefill_tokens_with_decodes
            self.prompt_tokens_per_s = slack.prompt_tokens_per_s(self.last_step_decodes, cap)

    def _step_overlapped(self, current: _InFlight) -> list[RequestOutput]:
        following = plan_following(self.scheduler, current.scheduled, self.max_model_len)
        launch = None
        if following is not None:
            self._planned(following.scheduled, following.ahead)
            launch = self.runner.launch(
                following.scheduled, following.ahead, current.launch, following.feed, self.eos_token_ids
            )
            self.num_overlapped_steps += 1
        tokens = iter(self.runner.collect(current.launch))
        collected_at, before = time.perf_counter(), self._collected_at
        self._collected_at = collected_at
        self._count_rows(current.scheduled)
        if current.chained and before is not None:  # from the last step's tokens to this one's: its time
            self._observe(collected_at - before)
        # Aborted while in flight: its token is dropped (its blocks were freed in stream order).
        # One pass over the rows: at a few hundred rows each pass is a measurable part of the step.
        live: list[ScheduledSeq] = []
        sampled: dict[str, SampledToken] = {}
        running = SeqStatus.RUNNING
        for item in current.scheduled:
            seq = item.seq
            token = next(tokens) if item.sample else None
            if seq.status is running:
                live.append(item)
                if token is not None:
                    sampled[seq.request_id] = SampledToken(token)
        outputs = self._finish_step(live, sampled)
        self._inflight = _InFlight(following.scheduled, launch, chained=True) if launch is not None else None
        return outputs

    def _finish_step(
        self, scheduled: list[ScheduledSeq], sampled: dict[str, SampledToken]
    ) -> list[RequestOutput]:
        return step_outputs(self.scheduler, self.requests, scheduled, sampled)

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


def _rows(scheduled: list[ScheduledSeq], ahead: list[int] | None = None) -> tuple[int, int]:
    """(decode rows, prompt tokens) of a step. A decode row computes one token past its prompt
    (`ahead[i]`: row i's tokens still in flight before the step); the rest are prompt chunks."""
    decodes = prompt_tokens = 0
    for k, item in enumerate(scheduled):
        seq = item.seq
        if item.num_new_tokens == 1 and seq.num_computed_tokens + (ahead[k] if ahead else 0) >= seq.num_prompt_tokens:
            decodes += 1
        else:
            prompt_tokens += item.num_new_tokens
    return decodes, prompt_tokens
