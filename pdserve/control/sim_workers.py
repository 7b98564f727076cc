"""The simulator's workers: a prefill worker (FIFO, prefix cache as an LRU of block hashes)
and a decode worker (continuous batching, advanced as a fluid between batch changes so that a
step costs no event). Both take their times from a `PerfModel`, stretched by `stretch`: the host
model's factor while workers share too few cores (1 when each owns its device)."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from pdserve.control.perf_model import PerfModel


class SimPrefill:
    """Steps as the engine does: each step takes the queued prompts in order up to a token
    budget (`max_num_batched_tokens`), the last one chunked to fill it, and every prompt whose
    last chunk is in the step gets its first token when the step ends."""

    def __init__(self, name: str, model: PerfModel, cache_blocks: int, block_size: int, budget: int) -> None:
        self.name = name
        self.model = model
        self.block_size = block_size
        self.budget = budget
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.queue: deque[int] = deque()
        self.queued_tokens = 0.0
        self.busy = False
        self.done = 0  # steps since start or flip (the first ones run cold)
        self.todo: dict[int, tuple[int, int]] = {}  # request in a step -> (uncached tokens, computed so far)
        self.stretch = 1.0
        self.work_left = 0.0  # of the step running: its time at stretch 1, still to go...
        self.last = 0.0  # ...as of this time
        self.version = 0  # bumps when the step's end moves: an end event of an older one is stale
        self.ending: list[int] = []  # requests whose prompt the running step finishes
        self.held: list[tuple[int, float]] = []  # (request, its first token): hand-overs waiting for this step

    def hit_tokens(self, hashes: tuple[int, ...], num_tokens: int) -> int:
        """Leading prompt tokens cached here, as the engine counts them (whole blocks, never
        the block holding the last token)."""
        n = 0
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            if h not in self.cache:
                break
            n += 1
        return n * self.block_size

    def store(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)

    def step(self, uncached: dict[int, int]) -> tuple[list[tuple[int, int, bool]], float]:
        """The next step over the queue: [(request, tokens computed, whether its prompt is done)]
        and its time. `uncached`: each queued request's uncached tokens, read when a step first
        takes it (the cache may have changed while it queued)."""
        chunks, left = [], self.budget
        for i in self.queue:
            if left <= 0:
                break
            if i not in self.todo:
                self.todo[i] = (uncached[i], 0)
            total, before = self.todo[i]
            c = min(total - before, left)
            chunks.append((i, before, c))
            left -= c
        m = self.model
        # One fixed cost a step; the n**2 term split over chunks so that a chunked prompt costs
        # what it costs whole.
        dt = m.p0 + sum(m.p1 * c + m.p2 * ((b + c) ** 2 - b * b) for _, b, c in chunks)
        cold = m.cold_factor if self.done < m.cold_steps else 1.0
        out = []
        for i, b, c in chunks:
            total, _ = self.todo[i]
            self.todo[i] = (total, b + c)
            out.append((i, c, b + c >= total))
        return out, dt * cold

    def begin(self, now: float, work: float) -> float:
        """A step of `work` seconds (at stretch 1) starts; returns when it ends at this stretch."""
        self.work_left, self.last = work, now
        self.version += 1
        return now + work * self.stretch

    def restretch(self, now: float, stretch: float) -> float | None:
        """The host's factor changes: the running step's end moves (returned), or None if idle."""
        if not self.busy:
            self.stretch = stretch
            return None
        self.work_left = max(0.0, self.work_left - (now - self.last) / self.stretch)
        self.last, self.stretch = now, stretch
        self.version += 1
        return now + self.work_left * stretch

    def finished(self, i: int) -> int:
        """A request whose prompt is done leaves the queue's head; returns its uncached tokens."""
        assert self.queue[0] == i
        self.queue.popleft()
        return self.todo.pop(i)[0]

    @property
    def idle(self) -> bool:
        return not self.busy and not self.queue


class SimDecode:
    """Every running sequence gains one token per step; between admissions and completions the
    batch is fixed, so the worker is a counter `v` of tokens per sequence since it started,
    and a sequence admitted at `v0` needing k tokens finishes when `v` reaches `v0 + k`."""

    def __init__(self, name: str, model: PerfModel, now: float) -> None:
        self.name = name
        self.model = model
        self.v = 0.0
        self.last = now
        self.ends: list[tuple[float, int]] = []  # (v at which it finishes, request)
        self.admitted: dict[int, tuple[float, int, int]] = {}  # request -> (v at admission, context, KV reserved)
        self.sum_prompt = 0.0  # context held at admission, all sequences
        self.sum_v0 = 0.0
        self.reserved = 0  # KV tokens reserved: prompt + output of every sequence
        self.steps = 0.0
        self.version = 0  # bumps on every change: a completion event of an older one is stale
        self.stretch = 1.0

    @property
    def batch(self) -> int:
        return len(self.admitted)

    @property
    def context(self) -> float:
        return self.sum_prompt + self.batch * self.v - self.sum_v0

    def step_s(self) -> float:
        m = self.model
        cold = m.cold_factor if self.steps < m.cold_steps else 1.0
        return m.served_step_s(self.batch, self.context) * cold * self.stretch

    def restretch(self, now: float, stretch: float) -> None:
        """The host's factor changes: tokens so far at the old one, the next at the new one."""
        self.advance(now)
        self.stretch = stretch
        self.version += 1

    def advance(self, now: float) -> None:
        if self.admitted and now > self.last:
            dv = (now - self.last) / self.step_s()
            self.v += dv
            self.steps += dv
        self.last = now

    def fits(self, prompt: int, output: int) -> bool:
        return self.batch < self.model.max_num_seqs and self.reserved + prompt + output <= self.model.kv_tokens

    def admit(self, rid: int, prompt: int, tokens: int, reserve: int) -> None:
        """`tokens` still to decode; `prompt`: the context it brings (prompt + tokens so far)."""
        self.admitted[rid] = (self.v, prompt, reserve)
        heapq.heappush(self.ends, (self.v + tokens, rid))
        self.sum_prompt += prompt
        self.sum_v0 += self.v
        self.reserved += reserve
        self.version += 1

    def remove(self, rid: int) -> float:
        """Take a sequence out (finished or moved); returns the tokens it had left."""
        v0, prompt, reserve = self.admitted.pop(rid)
        self.sum_prompt -= prompt
        self.sum_v0 -= v0
        self.reserved -= reserve
        self.version += 1
        left = 0.0
        for end, r in self.ends:
            if r == rid:
                left = end - self.v
        self.ends = [(e, r) for e, r in self.ends if r != rid]
        heapq.heapify(self.ends)
        return max(0.0, left)

    def pop_finished(self) -> list[int]:
        out = []
        while self.ends and self.ends[0][0] <= self.v + 1e-6:
            _, rid = heapq.heappop(self.ends)
            v0, prompt, reserve = self.admitted.pop(rid)
            self.sum_prompt -= prompt
            self.sum_v0 -= v0
            self.reserved -= reserve
            out.append(rid)
        if out:
            self.version += 1
        return out

    def next_finish(self, now: float) -> float | None:
        if not self.ends:
            return None
        return now + max(0.0, self.ends[0][0] - self.v) * self.step_s()
