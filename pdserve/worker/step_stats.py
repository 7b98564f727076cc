"""Engine step times by step kind and batch size, aggregated in the worker (pure: the caller
times the step and holds the loop's lock).

A step is `decode` (only decode rows), `prefill` (only prompt rows) or `mixed` (both); its
batch is the number of sequences it ran, bucketed as `BATCH_LABELS` say. Each (kind, batch)
series keeps a histogram of step seconds, the step count, their sum and the sequences summed,
in preallocated flat lists, so a step costs a few integer updates. `WorkerStats` carries the
series that saw a step (`fill`); the router turns them into `pdserve_engine_step_seconds`.
"""

from __future__ import annotations

from bisect import bisect_left

from pdserve_proto import inference_pb2

KINDS = ("decode", "prefill", "mixed")
# Upper bounds of the batch buckets; a batch above the last is "1025+".
_BATCH_UPPER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_LABELS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257-512", "513-1024", "1025+")
# Histogram bounds (seconds): fine where GPU steps fall, coarse up to CPU ones.
STEP_SECONDS_BOUNDS = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.006, 0.008, 0.012, 0.016, 0.024, 0.032, 0.048, 0.064,
    0.1, 0.25, 0.5, 1.0, 2.5,
)


def batch_bucket(num_seqs: int) -> str:
    """The label of the batch bucket a step of `num_seqs` sequences falls in (`num_seqs` >= 1)."""
    return BATCH_LABELS[_batch_index(num_seqs)]


def step_kind(decode_rows: int, prefill_rows: int) -> str | None:
    """decode, prefill or mixed; None for a step that ran no sequence."""
    if prefill_rows <= 0:
        return "decode" if decode_rows > 0 else None
    return "mixed" if decode_rows > 0 else "prefill"


def _batch_index(num_seqs: int) -> int:
    if num_seqs < 1:
        raise ValueError(f"num_seqs: {num_seqs}; a step runs at least one sequence")
    return bisect_left(_BATCH_UPPER, num_seqs)


class StepStats:
    def __init__(self) -> None:
        series = len(KINDS) * len(BATCH_LABELS)
        self._width = len(STEP_SECONDS_BOUNDS) + 1  # the last bucket is +Inf
        self._buckets = [0] * (series * self._width)
        self._steps = [0] * series
        self._seconds = [0.0] * series
        self._seqs = [0] * series

    def record(self, decode_rows: int, prefill_rows: int, seconds: float) -> None:
        """One engine step; a call that ran no sequence (it only launched one) is not a step."""
        n = decode_rows + prefill_rows
        if n <= 0:
            return
        kind = 0 if prefill_rows == 0 else (1 if decode_rows == 0 else 2)
        s = kind * len(BATCH_LABELS) + _batch_index(n)
        self._buckets[s * self._width + bisect_left(STEP_SECONDS_BOUNDS, seconds)] += 1
        self._steps[s] += 1
        self._seconds[s] += seconds
        self._seqs[s] += n

    def fill(self, stats: inference_pb2.WorkerStats) -> None:
        """Add every series that saw a step to `stats`, with the histogram's bounds."""
        stats.step_seconds_bounds.extend(STEP_SECONDS_BOUNDS)
        for s, steps in enumerate(self._steps):
            if not steps:
                continue
            kind, batch = divmod(s, len(BATCH_LABELS))
            stats.step_times.add(
                kind=KINDS[kind], batch=BATCH_LABELS[batch], count=steps, sum_seconds=self._seconds[s],
                sequences=self._seqs[s], bucket_counts=self._buckets[s * self._width:(s + 1) * self._width],
            )
