"""Configuration of a serving cluster (what `pdserve serve` takes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Slo
from pdserve.engine.args import EngineArgs
from pdserve.router.edge.auth import ApiKeys
from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.limits import InputLimits
from pdserve.router.edge.tls import TlsConfig
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.telemetry.tracing import TracingConfig


@dataclass(frozen=True)
class ControllerSettings:
    """`pdserve serve --controller`: the P:D controller moves workers between the pools
    (docs/controller.md). The budget is the workers started (prefill + decode)."""

    slo: Slo = field(default_factory=Slo)
    perf_model: str | None = None  # a built-in name or a JSON file; None: the CPU model on CPU, else the GPU one
    # The decision interval follows the measured flip time, never below this.
    min_interval_s: float = ControllerConfig.__dataclass_fields__["min_interval_s"].default
    window_s: float = 10.0  # arrival rates and latency percentiles over this much (at least an interval)
    # --max-workers: it may also add worker actors where Ray has room, up to this many in all, and
    # remove them again down to the workers started (None: those started, a fixed budget).
    max_workers: int | None = None
    # --controller-colocated: no prefill worker is a split it may choose (colocated), and back.
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.min_interval_s <= 0:
            raise ValueError(f"controller interval: {self.min_interval_s} s; must be > 0")
        if self.window_s <= 0:
            raise ValueError(f"controller window: {self.window_s} s; must be > 0")
        if self.max_workers is not None and self.max_workers < 2:
            raise ValueError(f"--max-workers: {self.max_workers}; a disaggregated cluster holds at least 2 workers")


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    num_prefill: int = 1  # 0: colocated, the decode workers prefill their own requests
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = None  # the OpenAI-compatible HTTP API on host (None: off; 0: a free port)
    ray_address: str | None = None  # None: start a local Ray cluster
    engine: EngineArgs = EngineArgs()  # every worker's engine settings (block size, KV pool, batch limits, ...)
    # Ranks (processes, on CPU) per worker of each pool: the widths may differ, since the KV moves
    # between any two (docs/kv-transfer.md, "Tensor-parallel workers").
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    # CPU workers: torch threads each. None: this host's cores shared out among the workers,
    # because two engines running OpenMP on the same cores stall each other at every barrier.
    cpu_threads_per_worker: int | None = None
    lease_s: float = 30.0
    # A decode worker aborts the requests of a router (`pdserve serve`'s or a `pdserve router`)
    # that has not polled it for this long, and frees their KV blocks.
    router_lease_s: float = 15.0
    transfer_timeout_s: float = 10.0
    # A checksum per KV block: computed by the prefill worker when it pins a prompt, checked by
    # the decode worker after its READ, which recomputes the prompt on a mismatch
    # (kv_transfer.checksum; what it costs: docs/benchmarks.md).
    kv_checksum: bool = True
    # The decode worker pulls a prompt's KV chunk by chunk while the prompt is still being
    # prefilled (RouterConfig.kv_transfer_overlap); off by default.
    kv_transfer_overlap: bool = False
    startup_timeout_s: float = 300.0
    placement: PlacementConfig = PlacementConfig()  # how the router places requests
    max_queued_requests: int = 0  # per pool, admitted without a token yet (RouterConfig's; 0: unbounded)
    poll_interval_s: float = 0.0  # at most one poll of a decode worker per this interval (RouterConfig's; 0: none)
    # How the router polls decode workers for tokens: "socket", a TCP connection to each worker
    # (pdserve.cluster.token_channel; far less CPU per poll), or "ray", an actor call per poll.
    token_transport: str = "socket"
    tracing: TracingConfig = TracingConfig()  # off by default; every process of the cluster uses it
    metrics_port: int | None = None  # Prometheus /metrics on host (None: off; 0: a free port)
    # Every router reads every worker's stats: with several routers only one should put the
    # workers' series on its /metrics, or a scrape of all of them counts each worker once per router.
    export_worker_metrics: bool = True
    # Router processes on this host sharing the gRPC and HTTP ports (pdserve.cluster.router_replicas):
    # one event loop relays every token of its streams, so one process caps a fleet's token rate.
    routers: int = 1
    # Bind the gRPC and HTTP ports with SO_REUSEPORT, beside other routers of this user on this host.
    reuse_port: bool = False
    # docs/security.md: keys and TLS of the gRPC and HTTP listeners, limits on each request.
    api_keys: ApiKeys = ApiKeys()  # none: the data plane is open (fine on loopback only)
    tls: TlsConfig | None = None  # None: plain TCP
    limits: InputLimits = InputLimits()
    http_options: HttpOptions = HttpOptions()  # the HTTP connections' timeouts, unknown request fields
    allow_special_tokens_in_prompt: bool = False  # a special token's text typed by a user is that token
    # The network device (UCX_NET_DEVICES, e.g. "lo", "eth1" or "mlx5_0:1") the workers' KV
    # transfers listen and connect on. None: loopback for a local cluster, UCX's choice (or the
    # UCX_NET_DEVICES of the environment) when joining one with ray_address.
    kv_net_devices: str | None = None
    controller: ControllerSettings | None = None  # None: the split stays as started (Admin.SetRole still flips)
    # --keep-workers: the stop of this router leaves the worker actors serving, for the next
    # `pdserve serve` to adopt (False: its stop stops the pools' workers, adopted ones included).
    keep_workers: bool = False

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks per worker of the pool `role` (prefill or decode)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        return self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size

    def tensor_parallel_sizes(self) -> dict[str, int]:
        """Ranks per worker of each pool, by pool name."""
        return {"prefill": self.prefill_tensor_parallel_size, "decode": self.decode_tensor_parallel_size}

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill: {self.num_prefill} workers; use 0 for a colocated cluster")
        if self.num_decode < 1:
            raise ValueError(f"num_decode: {self.num_decode} workers; every cluster needs at least one decode worker")
        for role in ("prefill", "decode"):
            if getattr(self, f"{role}_tensor_parallel_size") < 1:
                raise ValueError(f"{role}_tensor_parallel_size: must be >= 1, not {getattr(self, f'{role}_tensor_parallel_size')}")
        if self.cpu_threads_per_worker is not None and self.cpu_threads_per_worker < 1:
            raise ValueError(f"cpu_threads_per_worker: {self.cpu_threads_per_worker}; must be >= 1 (or None: shared out)")
        if self.router_lease_s <= 0:
            raise ValueError(f"router_lease_s: {self.router_lease_s}; a router's lease must be positive")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: {self.max_queued_requests}; must be >= 0 (0: unbounded)")
        if not 0 <= self.poll_interval_s < 1:
            raise ValueError(f"poll_interval_s: {self.poll_interval_s}; must be in [0, 1) seconds (0: no floor)")
        if self.token_transport not in ("socket", "ray"):
            raise ValueError(f"token_transport: {self.token_transport!r}; must be 'socket' or 'ray'")
        if self.routers < 1:
            raise ValueError(f"routers: {self.routers}; at least one router serves the cluster")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port: {self.http_port} is not a TCP port")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: {self.metrics_port} is not a TCP port")
        if self.controller is not None and self.num_prefill < 1 and not self.controller.colocated:
            raise ValueError(
                "controller: needs a prefill pool to balance against the decode pool (--prefill >= 1), unless it may "
                "serve colocated (--controller-colocated)"
            )
        if self.keep_workers and self.ray_address is None:
            raise ValueError(
                "--keep-workers: only with --address; the workers of the Ray instance this command starts stop with it"
            )
        started = self.num_prefill + self.num_decode
        if self.controller is not None and (self.controller.max_workers or started) < started:
            raise ValueError(
                f"--max-workers: {self.controller.max_workers} is below the {started} workers started "
                "(--prefill + --decode); it must be at least that"
            )
