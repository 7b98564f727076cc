"""The simulator's colocated worker: one engine in role "both" that prefills and decodes. Each
step carries every running decode (a token each) and, in the token budget left
(`max_num_batched_tokens` less the decodes), prompt chunks in arrival order: first the prompts
already being chunked, then new ones while `max_num_seqs` and the KV pool allow. Pure: no clock,
no events; the colocated simulation (`sim_colocated`) times the steps.

A mixed step costs the prefill time of its chunks (their fixed part the model's `mixed_p0` where
it has one) plus the served decode step of its batch; the engine's measured mixed steps are that
sum to within a few per cent (docs/controller.md, "Disaggregated or colocated"). With an ITL target
the prompt tokens beside decodes are held to what the engine's `StepSlack` allows, as there."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from pdserve.control.perf_model import PerfModel
from pdserve.control.sim_workers import SimPrefill
from pdserve.engine.step_slack import StepSlack


@dataclass(frozen=True)
class MixedStep:
    """One step's content: the decodes it advances, the prompt chunks (request, tokens before,
    tokens computed now) and its time at stretch 1."""

    decodes: int
    chunks: tuple[tuple[int, int, int], ...]
    seconds: float


class SimMixed:
    """A colocated worker's queue, running batch, KV reservations and prefix cache. `begin`
    composes the next step; `end` applies it and says which prompts got their first token and
    which sequences finished."""

    def __init__(
        self, name: str, model: PerfModel, cache_blocks: int, block_size: int, budget: int,
        itl_target_s: float | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.model = model
        self.budget = budget
        # `--itl-target-ms`: the engine's own pacing of prompt tokens beside decodes, fed the
        # simulated steps' times as the engine feeds it the measured ones.
        self.slack = StepSlack(itl_target_s) if itl_target_s is not None else None
        # The prefix cache is the prefill worker's (an LRU of block hashes, whole blocks only).
        self.cache = SimPrefill(name, model, cache_blocks, block_size, budget)
        self.waiting: deque[int] = deque()  # placed here, not admitted yet
        self.prompts: dict[int, list[int]] = {}  # admitted, prompt not done -> [uncached, computed]
        self.ends: list[tuple[int, int]] = []  # (step at whose end it finishes, request) of decodes
        self.decode_ctx: dict[int, int] = {}  # decoding request -> its context at `joined`
        self.joined: dict[int, int] = {}  # decoding request -> the step count when it joined
        self.context = 0  # tokens held by the decoding sequences, as of `steps`
        self.reserved = 0  # KV tokens reserved: prompt + output of every admitted sequence
        self.reserve: dict[int, int] = {}
        self.steps = 0  # steps ended since start
        self.busy = False
        self.version = 0
        self.current: MixedStep | None = None

    @property
    def batch(self) -> int:
        return len(self.decode_ctx)

    @property
    def running(self) -> int:
        """Sequences holding a place in the batch: decoding, or admitted and still prefilling."""
        return len(self.decode_ctx) + len(self.prompts)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prompts or self.decode_ctx)

    def begin(self, lengths: dict[int, tuple[int, int, tuple[int, ...]]]) -> MixedStep:
        """The next step: `lengths` gives each request's (prompt tokens, output tokens, block
        hashes). Admits waiting prompts as the engine's scheduler does."""
        m = self.model
        left = self.budget - self.batch
        if self.slack is not None and self.batch:
            left = min(left, self.slack.room(self.batch))
        chunks: list[tuple[int, int, int]] = []
        for i, (total, before) in self.prompts.items():  # prompts being chunked go first, in order
            if left <= 0:
                break
            c = min(total - before, left)
            chunks.append((i, before, c))
            left -= c
        while self.waiting and left > 0 and self.running < m.max_num_seqs:
            i = self.waiting[0]
            prompt, output, hashes = lengths[i]
            if self.reserved + prompt + output > m.kv_tokens and self.running:
                break  # no KV room until a sequence ends (alone, it is let in: nothing else would free it)
            self.waiting.popleft()
            total = prompt - self.cache.hit_tokens(hashes, prompt)
            self.prompts[i] = [total, 0]
            self.reserve[i] = prompt + output
            self.reserved += prompt + output
            c = min(total, left)
            chunks.append((i, 0, c))
            left -= c
        t = 0.0
        if chunks:  # as a prefill worker's step: one fixed cost, the n**2 term split over chunks
            fixed = m.mixed_fixed_s if self.batch else m.p0  # beside decodes, the chunks' own fixed part
            t += fixed + sum(m.p1 * c + m.p2 * ((b + c) ** 2 - b * b) for _, b, c in chunks)
        if self.batch:
            t += m.served_step_s(self.batch, self.context)
        cold = m.cold_factor if self.steps < m.cold_steps else 1.0
        self.current = MixedStep(self.batch, tuple(chunks), t * cold)
        if self.slack is not None:
            self.slack.took(self.batch, sum(c for _, _, c in chunks))
        self.busy = True
        self.version += 1
        return self.current

    def end(self, lengths: dict[int, tuple[int, int, tuple[int, ...]]]) -> tuple[list[int], list[int]]:
        """The step ran: ([requests whose prompt it finished], [requests that finished]). A
        finished prompt joins the decodes (or finishes, with one output token)."""
        step = self.current
        assert step is not None and self.busy
        self.busy, self.current = False, None
        if self.slack is not None:
            self.slack.observe(step.decodes, sum(c for _, _, c in step.chunks), step.seconds)
        self.steps += 1
        self.context += step.decodes
        done: list[int] = []
        while self.ends and self.ends[0][0] <= self.steps:
            _, i = heapq.heappop(self.ends)
            self.context -= self.decode_ctx.pop(i) + self.steps - self.joined.pop(i)
            done.append(i)
        prefilled: list[int] = []
        for i, before, c in step.chunks:
            total, _ = self.prompts[i]
            if before + c < total:
                self.prompts[i][1] = before + c
                continue
            del self.prompts[i]
            prompt, output, hashes = lengths[i]
            self.cache.store(hashes)
            prefilled.append(i)
            if output <= 1:
                done.append(i)
                continue
            # The first token came from this step; the other output - 1 come one a step.
            self.decode_ctx[i], self.joined[i] = prompt + 1, self.steps
            self.context += prompt + 1
            heapq.heappush(self.ends, (self.steps + output - 1, i))
        for i in done:
            self.reserved -= self.reserve.pop(i)
        return prefilled, done
