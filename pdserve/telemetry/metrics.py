"""The router's Prometheus metrics, in a registry the caller owns.

Names follow Prometheus conventions: `pdserve_` prefix, base units (seconds, bytes), `_total`
on counters. Workers' figures are not here: `ClusterCollector` reads them at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets in seconds: sub-millisecond inter-token gaps up to minute-long requests.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TRANSFER = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_PAUSE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_requests", "Requests finished, by outcome (a finish reason, or the gRPC status of a failure).",
            ["outcome"], registry=r,
        )
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served now.", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of placed requests.", registry=r)
        self.cached_prompt_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache of the worker that prefilled them.", registry=r,
        )
        self.prefilled_tokens = Counter(
            "pdserve_prefilled_tokens",
            "Prompt tokens computed by a prefill (prompt tokens less those served from a prefix cache).",
            registry=r,
        )
        self.prefill_location = Counter(
            "pdserve_prefills",
            "Placed requests by where their prompt is prefilled: on a prefill worker (remote) or on their "
            "decode worker (local: colocated serving or conditional disaggregation).",
            ["location"], registry=r,
        )
        for location in ("local", "remote"):
            self.prefill_location.labels(location)
        self.prefill_overflows = Counter(
            "pdserve_prefill_overflows",
            "Requests prefilled on their decode worker because every prefill worker was at its in-flight cap, "
            "or had --max-prefill-queue-tokens in flight (also counted as local in pdserve_prefills).",
            registry=r,
        )
        self.failovers = Counter(
            "pdserve_failovers",
            "Requests moved off a worker that failed them (dead, unreachable or past its deadline), by "
            "what moved: a prefill, a KV hand-over to another decode worker, or a stream resumed mid-way.",
            ["stage"], registry=r,
        )
        for stage in ("prefill", "handover", "stream"):
            self.failovers.labels(stage)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens sent to clients.", registry=r)
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "From the request's arrival to its first token.",
            buckets=_LATENCY, registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive tokens of one stream.",
            buckets=_LATENCY, registry=r,
        )
        self.e2e = Histogram(
            "pdserve_request_duration_seconds", "From the request's arrival to its last token.",
            buckets=_LATENCY, registry=r,
        )
        self.prefill_wait = Histogram(
            "pdserve_prefill_duration_seconds",
            "Prefill as the router sees it: queueing and compute on the worker (for a local prefill, until the "
            "decode worker's first token).",
            buckets=_LATENCY, registry=r,
        )
        self.prefill_queue = Histogram(
            "pdserve_prefill_queue_seconds",
            "How long a prompt waited in its prefill worker's queue before its first prefill step "
            "(reported by the worker; part of pdserve_prefill_duration_seconds).",
            buckets=_LATENCY, registry=r,
        )
        self.prefill_compute = Histogram(
            "pdserve_prefill_compute_seconds",
            "From a prompt's first prefill step to the end of its last (reported by the worker; part of "
            "pdserve_prefill_duration_seconds).",
            buckets=_LATENCY, registry=r,
        )
        self.prefill_overhead = Histogram(
            "pdserve_prefill_overhead_seconds",
            "What a prefill call cost beyond queue and compute: part=worker, the worker's own (block checksums, "
            "the answer); part=transport, the call's way there and back (the router's wait less the worker's time); "
            "part=send and part=reply, that way there and that way back apart, by the router's and the worker's wall "
            "clocks (exact on one host).",
            ["part"], buckets=_LATENCY, registry=r,
        )
        self.local_submit = Histogram(
            "pdserve_local_prefill_submit_seconds",
            "A local prefill's submit call (part of its pdserve_prefill_duration_seconds): part=call, the router's "
            "whole wait for it; part=worker, the decode worker's time on it (queueing the prompt in its engine, "
            "the wait for the engine loop's lock included); part=send and part=reply, the way there and the way "
            "back, by the router's and the worker's wall clocks (exact on one host).",
            ["part"], buckets=_LATENCY, registry=r,
        )
        self.loop_lag = Histogram(
            "pdserve_router_event_loop_lag_seconds",
            "How much later than asked the router's event loop woke a task sleeping 20 ms: how long a callback "
            "that became ready (a worker's answer, a token to relay) waited behind the loop's other work.",
            buckets=_PAUSE, registry=r,
        )
        self.gc_pause = Histogram(
            "pdserve_router_gc_pause_seconds",
            "Garbage collections of the router's process, by generation; every thread of it stops for one.",
            ["generation"], buckets=_PAUSE, registry=r,
        )
        self.decode_wait = Histogram(
            "pdserve_decode_queue_seconds", "From the KV hand-over to the first token the decode worker produced.",
            buckets=_LATENCY, registry=r,
        )
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_duration_seconds", "One KV READ from a prefill worker into a decode worker.",
            buckets=_TRANSFER, registry=r,
        )
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes READ between workers.", registry=r)
        self.transfer_blocks = Counter("pdserve_kv_transfer_blocks", "KV blocks READ between workers.", registry=r)
        self.transfer_rate = Gauge(
            "pdserve_kv_transfer_last_bytes_per_second", "Throughput of the latest KV READ.", registry=r
        )
        self.transfer_retries = Counter(
            "pdserve_kv_transfer_retries", "KV READs that failed and were tried again.", registry=r
        )
        self.handover_waits = Counter(
            "pdserve_kv_handover_waits",
            "KV hand-overs that found their decode worker without free blocks for the prompt and were tried "
            "again until it had them (or the prefill worker's KV lease ran short).",
            registry=r,
        )
        self.recomputes = Counter(
            "pdserve_kv_recomputes", "Requests whose KV never arrived and were prefilled on the decode worker.",
            registry=r,
        )
        self.link_test = Gauge(
            "pdserve_kv_link_test_bytes_per_second", "Start-up link self-test of each decode <- prefill KV link.",
            ["decode", "prefill"], registry=r,
        )
        # The P:D split: kept current by the router whatever drives it (the controller, Admin.SetRole).
        self.pool_workers = Gauge(
            "pdserve_pool_workers", "Workers in placement now, by pool (a worker mid-flip is in neither).",
            ["role"], registry=r,
        )
        # Set only by the router that keeps the pools at their size (`pdserve serve`'s), so that
        # several routers' scrapes count each pool once.
        self.reconciler_workers = Gauge(
            "pdserve_reconciler_workers",
            "Each pool's workers as the reconciler keeps it: desired (its size), ready, starting (replacements "
            "loading) and failed (replacement starts that failed since the pool last had its size).",
            ["pool", "state"], registry=r,
        )
        self.pool_target = Gauge(
            "pdserve_pool_target", "The P:D controller's target number of workers, by pool (0 without --controller).",
            ["role"], registry=r,
        )
        self.mode_load = Gauge(
            "pdserve_mode_load",
            "With --controller: the predicted load (1.0: the most within the SLOs) of the workers colocated and of "
            "their best P:D split; the lower is the mode the load favours (0 without --controller).",
            ["mode"], registry=r,
        )
        self.role_changes = Counter(
            "pdserve_role_changes",
            "Role flips that finished, by the pool the worker left (from) and the one it joined (to).",
            ["from", "to"], registry=r,
        )
        self.controller_decisions = Counter(
            "pdserve_controller_decisions",
            "The P:D controller's recorded decisions: flips, workers added and removed (--max-workers), and holds "
            "that nearly were one of them (action hold).",
            ["action"], registry=r,
        )
        for role in ("prefill", "decode"):
            self.pool_workers.labels(role)
            self.pool_target.labels(role)
            self.role_changes.labels(role, "decode" if role == "prefill" else "prefill")
        for mode in ("colocated", "disaggregated"):
            self.mode_load.labels(mode)
        for action in ("flip", "add", "remove", "hold"):
            self.controller_decisions.labels(action)
