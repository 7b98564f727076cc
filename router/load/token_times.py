"""Measured decode time per token, by how many requests the router has on the decode worker, as
the router's clients see it (engine step, poll and relay together): what deadline admission
(`router.deadline_admission`) predicts a request's decode from. Pure: the caller passes the time.

Each relay poll gives, per stream that had an earlier token, the time since that token over the
tokens it brought; their mean is one sample at the worker's request count. Samples go to power
of two buckets of that count, each a running mean of the time and of the count."""

from __future__ import annotations

from collections.abc import Iterable

# Weight of the newest sample in a bucket's running mean: about the last 20 polls count, as one
# token's time varies severalfold from poll to poll where the host is busy.
SMOOTHING = 0.05
MAX_TRACKED = 65_536  # streams whose last token time is kept (a lost close must not grow it)


def bucket_of(count: int) -> int:
    """The bucket of a request count: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return max(0, count - 1).bit_length()


class DecodeTokenTimes:
    """Running means of seconds per decode token by the decode worker's request count, and the
    curve through them (`per_token_s`)."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: {smoothing}; must be in (0, 1]")
        self.smoothing = smoothing
        self._buckets: dict[int, tuple[float, float]] = {}  # bucket -> (mean count, mean seconds per token)
        self._last: dict[str, float] = {}  # request id -> when its last tokens came

    def delivered(self, now: float, count: int, streams: Iterable[tuple[str, int, bool]]) -> None:
        """One poll of a decode worker that holds `count` of the router's requests answered at
        `now` with tokens for `streams`: (request id, tokens, finished)."""
        merged: dict[str, tuple[int, bool]] = {}  # a poll may carry several updates of one stream
        for rid, tokens, finished in streams:
            n, ended = merged.get(rid, (0, False))
            merged[rid] = (n + tokens, ended or finished)
        gaps = []
        for rid, (tokens, finished) in merged.items():
            last = self._last.pop(rid, None) if finished else self._last.get(rid)
            if tokens > 0 and last is not None and now > last:
                gaps.append((now - last) / tokens)
            if tokens > 0 and not finished:
                self._last[rid] = now
        if len(self._last) > MAX_TRACKED:
            self._last.clear()
        if gaps and count > 0:
            self.add(count, sum(gaps) / len(gaps))

    def forget(self, rid: str) -> None:
        """The request ended: no later poll brings it a token."""
        self._last.pop(rid, None)

    def add(self, count: int, seconds_per_token: float) -> None:
        """One sample: a token took `seconds_per_token` while the worker held `count` requests."""
        b = bucket_of(count)
        prev = self._buckets.get(b)
        if prev is None:
            self._buckets[b] = (float(count), seconds_per_token)
            return
        a = self.smoothing
        self._buckets[b] = (prev[0] + a * (count - prev[0]), prev[1] + a * (seconds_per_token - prev[1]))

    @property
    def measured(self) -> bool:
        return bool(self._buckets)

    def per_token_s(self, count: int) -> float | None:
        """Seconds per token at `count` requests on the worker; None before any sample.

        Conservative: the curve never falls as the count grows (noise does not make a fuller
        worker look faster), below the first point it is that point, between points it is the
        line through them, and past the last the line through the last two (one point only:
        time per token in proportion to the count, as if batching gained nothing)."""
        points = [self._buckets[b] for b in sorted(self._buckets)]
        if not points:
            return None
        xs, ys, top = [], [], 0.0
        for x, y in points:
            top = max(top, y)
            xs.append(x)
            ys.append(top)
        if count <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * count / xs[0]
        for i in range(1, len(xs)):
            if count <= xs[i]:
                return _line(xs[i - 1], ys[i - 1], xs[i], ys[i], count)
        return _line(xs[-2], ys[-2], xs[-1], ys[-1], count)


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    if x1 <= x0:
        return max(y0, y1)
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
