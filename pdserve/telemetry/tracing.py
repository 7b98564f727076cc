"""Tracing set-up from flags and the standard OTEL_* environment variables.

Off by default: the tracer is OpenTelemetry's no-op tracer, so instrumented code costs one call
that returns a shared non-recording span. On, each process gets its own TracerProvider with a
parent-based ratio sampler (a request sampled at the router is traced in every worker it
touches) and a batching exporter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

EXPORTERS = ("none", "console", "otlp-grpc", "otlp-http")
INSTRUMENTATION = "pdserve"


@dataclass(frozen=True)
class TracingConfig:
    exporter: str = "none"  # one of EXPORTERS
    endpoint: str | None = None  # OTLP: host:port (gRPC) or http://host:port/v1/traces (HTTP); None: exporter default
    sample_ratio: float = 1.0
    service_name: str = "pdserve"
    export_delay_s: float = 1.0  # how long finished spans may wait in the batch before export

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"trace_exporter: {self.exporter!r} is not one of {', '.join(EXPORTERS)}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio: {self.sample_ratio} is outside [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        """Read OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL/ENDPOINT,
        OTEL_TRACES_SAMPLER(_ARG) and OTEL_SERVICE_NAME, as the OpenTelemetry spec defines them."""
        env = os.environ if env is None else env
        names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
        name = names[0] if names else "none"
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if name == "otlp":
            exporter = "otlp-http" if protocol.startswith("http") else "otlp-grpc"
        elif name in ("console", "none"):
            exporter = name
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: {name!r} is not otlp, console or none")
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint is None and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            base = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/")
            # The spec: the generic endpoint is a base URL; HTTP appends the signal's path.
            endpoint = base + "/v1/traces" if exporter == "otlp-http" else base
        ratio = 1.0
        sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        if sampler.endswith("always_off"):
            ratio = 0.0
        elif sampler.endswith("traceidratio"):
            ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        return cls(exporter, endpoint, ratio, env.get("OTEL_SERVICE_NAME", "pdserve"))

    def overridden(
        self, exporter: str | None = None, endpoint: str | None = None, sample_ratio: float | None = None
    ) -> TracingConfig:
        """Flags win over the environment; None leaves a field as it is."""
        return replace(
            self,
            exporter=self.exporter if exporter is None else exporter,
            endpoint=self.endpoint if endpoint is None else endpoint,
            sample_ratio=self.sample_ratio if sample_ratio is None else sample_ratio,
        )


class Tracing:
    """One process's tracer and the provider behind it (None when tracing is off)."""

    def __init__(self, tracer: trace.Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self.provider = provider

    @classmethod
    def off(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    def flush(self, timeout_s: float = 10.0) -> bool:
        if self.provider is None:
            return True
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def build_tracing(config: TracingConfig, role: str, worker_id: str | None = None) -> Tracing:
    """The tracer for one process: `role` is router, prefill or decode."""
    if not config.enabled:
        return Tracing.off()
    attrs = {"service.name": config.service_name, "pdserve.role": role, "process.pid": os.getpid()}
    if worker_id is not None:
        attrs["pdserve.worker_id"] = worker_id
    provider = TracerProvider(
        resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
    )
    provider.add_span_processor(
        BatchSpanProcessor(_exporter(config), schedule_delay_millis=max(1, int(config.export_delay_s * 1000)))
    )
    return Tracing(provider.get_tracer(INSTRUMENTATION), provider)


def _exporter(config: TracingConfig) -> SpanExporter:
    # Imported here: the OTLP exporters pull in gRPC / HTTP clients a process without tracing never needs.
    if config.exporter == "console":
        return ConsoleSpanExporter(service_name=config.service_name)
    if config.exporter == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = config.endpoint
        insecure = endpoint is None or not endpoint.startswith("https://")
        return GrpcExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.endpoint)
