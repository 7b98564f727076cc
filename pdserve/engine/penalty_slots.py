"""The repetition, frequency and presence penalties with their state on the device: a table of
slots, one per penalized sequence, holding its output count of every token and which tokens its
prompt has. A step then adds only its new tokens to the table (a draw still on the device too)
and applies the penalties over its rows in a fixed handful of whole-row operations, so its host
work does not grow with the tokens a row holds: on a GPU the step's short enough for that to show.

Bit for bit the result of `logits_processing`'s sparse path (the same arithmetic per element; a
token a row does not hold is left as it is). Everything derives from the tokens: a slot is filled
from a sequence's tokens when it has none, when its tokens no longer continue what it counted,
and after its slot went to another sequence (least recently used first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.step_inputs import to_device

MIN_SLOTS = 8


@dataclass
class _Slot:
    owner: object  # held, so that no later sequence can take its id() while the slot lives
    index: int
    split: int  # tokens before the output
    counted: int  # leading tokens counted (a draw counted on the device included)
    used: int  # the call that last used it


class PenaltySlots:
    """The penalty state of one engine's penalized sequences, on `device`, over `vocab` tokens."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self._slots: OrderedDict[int, _Slot] = OrderedDict()  # id(owner) -> slot, least recent first
        self._capacity = 0
        self._calls = 0
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=device)  # output count per token
        self.in_prompt = torch.zeros((0, vocab), dtype=torch.bool, device=device)
        self.fills = 0  # slots filled from a sequence's tokens (first use, rebuilds, evictions)

    def prepare(
        self, owners: Sequence[object], tokens: Sequence[Sequence[int] | np.ndarray], splits: Sequence[int],
        pending: Sequence[bool],
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Bring the rows' slots up to date and return (the slot of each row, the [2, k] (slot,
        token) counts still to add, for `add`): row i's `tokens[i]` (prompt, then output from
        `splits[i]` on) counted and, where `pending[i]`, one draw more that is still on the
        device (`count_pending` adds it). A slot (re)filled from the tokens is filled here."""
        self._calls += 1
        fill: list[tuple[int, np.ndarray, int]] = []
        add_at: list[int] = []
        add_tok: list[int] = []
        slots = np.empty(len(owners), dtype=np.int64)
        for i, (owner, toks, split) in enumerate(zip(owners, tokens, splits)):
            slot = self._slots.get(id(owner))
            n = len(toks)
            if slot is None or slot.owner is not owner or slot.split != split or slot.counted > n:
                slot = self._take(owner, split)
                fill.append((slot.index, np.asarray(toks, dtype=np.int64), split))
            elif slot.counted < n:
                new = [int(t) for t in toks[slot.counted : n] if t < self.vocab]
                add_at += [slot.index] * len(new)
                add_tok += new
            self._slots.move_to_end(id(owner))
            slot.counted, slot.used = n + int(pending[i]), self._calls
            slots[i] = slot.index
        for index, toks, split in fill:
            self._fill(index, toks, split)
        return slots, np.asarray([add_at, add_tok], dtype=np.int64).reshape(2, -1)

    def add(self, updates: torch.Tensor) -> None:
        """Count the (slot, token) pairs of `updates` ([2, k] on the device) once each."""
        self._count(updates[0], updates[1])

    def count_pending(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the draws still on the device: token `tokens[j]` in slot `slots[j]`."""
        self._count(slots, tokens)

    def _count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        # index_add_ on the flat table: one atomic-add kernel, where an accumulating index_put_
        # sorts its indices first (several launches); integer counts add up the same either way.
        self.counts.view(-1).index_add_(0, slots * self.vocab + tokens, torch.ones_like(slots, dtype=torch.int32))

    def apply(
        self, x: torch.Tensor, slots: torch.Tensor, knobs: torch.Tensor, use_rep: bool, use_counts: bool
    ) -> torch.Tensor:
        """The penalties on `x` (the logits of the penalized rows, [R, vocab]) from their `slots`
        ([R]); `knobs` [R, 3] (repetition, frequency, presence) in `x`'s dtype."""
        count = self.counts.index_select(0, slots)
        if use_rep:
            held = self.in_prompt.index_select(0, slots) | (count > 0)
            rep = knobs[:, 0:1]
            # As vLLM and transformers do: a positive logit is divided, a negative one multiplied.
            x = torch.where(held, torch.where(x > 0, x / rep, x * rep), x)
        if use_counts:
            c = count.to(x.dtype)
            # Two plain steps (no fused multiply-add), so the rounding is the same on every device.
            x = x - c * knobs[:, 1:2]
            x = x - c.clamp(max=1.0) * knobs[:, 2:3]
        return x

    def _take(self, owner: object, split: int) -> _Slot:
        """A slot for `owner`: its own (refilled), the least recently used one of an earlier call
        when the table is full, or a new one (the table doubles when full)."""
        old = self._slots.pop(id(owner), None)
        if old is not None:
            index = old.index
        else:
            lru = next(iter(self._slots.values()), None)
            if lru is not None and lru.used < self._calls and len(self._slots) >= self._capacity:
                index = self._slots.pop(id(lru.owner)).index
            else:
                index = self._grow()
        slot = self._slots[id(owner)] = _Slot(owner, index, split, 0, self._calls)
        return slot

    def _grow(self) -> int:
        """A new slot index; the table doubles when it is full."""
        used = len(self._slots)
        if used >= self._capacity:
            cap = max(MIN_SLOTS, 2 * self._capacity)
            counts = torch.zeros((cap, self.vocab), dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros((cap, self.vocab), dtype=torch.bool, device=self.device)
            counts[: self._capacity] = self.counts
            in_prompt[: self._capacity] = self.in_prompt
            self.counts, self.in_prompt, self._capacity = counts, in_prompt, cap
        return used

    def _fill(self, index: int, tokens: np.ndarray, split: int) -> None:
        """Slot `index` from a sequence's tokens: prompt `tokens[:split]`, output after."""
        self.fills += 1
        prompt, out = tokens[: max(0, split)], tokens[max(0, split) :]
        prompt, out = prompt[prompt < self.vocab], out[out < self.vocab]  # past the logits: penalized nowhere
        self.counts[index].zero_()
        self.in_prompt[index].zero_()
        if len(prompt):
            self.in_prompt[index].index_fill_(0, to_device(np.unique(prompt), self.device), True)
        if len(out):
            values, times = np.unique(out, return_counts=True)
            dev = to_device(np.stack([values, times.astype(np.int64)]), self.device)
            self.counts[index].index_copy_(0, dev[0], dev[1].to(torch.int32))
