"""One /metrics for the routers of `pdserve serve --routers N`, as vLLM's API servers share one:
each replica serves its registry on a loopback port, and at each scrape the first router adds
those series into its own (`FederatedCollector`, `merge_families`). Counters, histograms and
summaries are summed over the routers (`_created` the earliest); a gauge is the first router's
own (pools, targets and links are the cluster's), but those that add up (`ADDITIVE_GAUGES`). A
replica that does not answer in time is left out of that scrape. docs/observability.md."""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

ADDITIVE_GAUGES = frozenset({"pdserve_requests_in_flight"})
SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
# A family's samples are named after it with one of these.
_SUFFIXES = ("", "_total", "_created", "_bucket", "_count", "_sum", "_gcount", "_gsum", "_info")
PEER_TIMEOUT_S = 2.0
_WARN_EVERY_S = 60.0

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels


def _key(name: str, labels: dict[str, str]) -> Key:
    return name, tuple(sorted(labels.items()))


def parse_samples(text: str) -> dict[Key, float]:
    """Every sample of an exposition, by name and labels."""
    return {_key(s.name, s.labels): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def merge_families(
    own: Iterable[Metric], others: Sequence[dict[Key, float]], additive_gauges: frozenset[str] = ADDITIVE_GAUGES
) -> list[Metric]:
    """`own`'s families with `others`' samples (`parse_samples`) added by the rules above;
    samples of a family only another router has (a label value this router has not seen yet)
    join that family. Samples no family of `own` names are dropped."""
    families = list(own)
    owner: dict[str, int] = {}
    for i, family in enumerate(families):
        for suffix in _SUFFIXES:
            owner.setdefault(family.name + suffix, i)
    merged: list[dict[Key, Sample]] = [{_key(s.name, s.labels): s for s in f.samples} for f in families]
    for other in others:
        for (name, labels), value in other.items():
            i = owner.get(name)
            if i is None:
                continue
            family = families[i]
            summed = family.type in SUMMED_TYPES or (family.type == "gauge" and family.name in additive_gauges)
            if not summed:
                continue
            samples = merged[i]
            have = samples.get((name, labels))
            if have is None:
                samples[(name, labels)] = Sample(name, dict(labels), value)
            elif name.endswith("_created") and name != family.name:
                samples[(name, labels)] = have._replace(value=min(have.value, value))
            else:
                samples[(name, labels)] = have._replace(value=have.value + value)
    out = []
    for family, samples in zip(families, merged):
        m = Metric(family.name, family.documentation, family.type, family.unit)
        m.samples = list(samples.values())
        out.append(m)
    return out


def fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:  # loopback URLs this process was given
        return answer.read().decode()


class FederatedCollector:
    """Collects `registry` with the series of the routers at `peers()` (their /metrics URLs)
    added in (`merge_families`)."""

    def __init__(
        self, registry: CollectorRegistry, peers: Callable[[], Sequence[str]], timeout_s: float = PEER_TIMEOUT_S,
        read: Callable[[str, float], str] = fetch,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.peers = peers
        self.timeout_s = timeout_s
        self._read = read
        self._warned_at = -_WARN_EVERY_S

    def collect(self) -> Iterator[Metric]:
        others = []
        for url in self.peers():
            try:
                others.append(parse_samples(self._read(url, self.timeout_s)))
            except Exception as exc:  # noqa: BLE001 - a replica that is down or slow is left out of this scrape
                now = time.monotonic()
                if now - self._warned_at >= _WARN_EVERY_S:
                    self._warned_at = now
                    log.warning("metrics: router replica at %s left out of this scrape: %s", url, exc)
        yield from merge_families(self.registry.collect(), others)
