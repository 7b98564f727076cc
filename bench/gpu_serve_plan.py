"""What `bench/gpu_serve.py` runs, as data: the server configurations and the command lines that
start them, the workloads, the rates, the plan of one invocation and how long it should take.
Pure: no process is started and no file is read here.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.serve_workload import Request, Shape, lognormal, prefix_groups

# ----- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Lengths in tokens at scale 1 (a GPU serving a 1B-8B model); `scale` shrinks them for a CPU."""

    name: str
    shape: Shape  # prompt (or, with a prefix, the suffix after it) and output lengths
    max_input: int
    max_output: int
    prefix_len: int = 0  # > 0: every prompt starts with one of `groups` shared prefixes this long
    groups: int = 0

    def requests(self, n: int, seed: int, scale: float = 1.0) -> list[Request]:
        max_input = max(1, round(self.max_input * scale))
        if self.prefix_len:
            return prefix_groups(n, seed, self.groups, self.prefix_len, self.shape, max_input, self.max_output, scale)
        return lognormal(self.shape, n, seed, max_input, self.max_output, scale)

    def max_len(self, scale: float = 1.0) -> int:
        """The longest prompt + output a request can have: the context the servers must allow."""
        return round(self.prefix_len * scale) + max(1, round(self.max_input * scale)) + self.max_output


# Lognormal medians from means: mean = median * exp(sigma^2 / 2).
WORKLOADS: dict[str, Workload] = {
    # RAG-like: a long retrieved context, a short answer; nearly fixed lengths.
    "long-prompt": Workload("long-prompt", Shape(3000, 150, sigma=0.1), max_input=3600, max_output=180),
    # Chat: means ~1000 prompt and ~200 output tokens, lognormal sigma 0.5.
    "chat": Workload("chat", Shape(882, 176, sigma=0.5), max_input=4000, max_output=600),
    # 8 shared 2048-token prefixes (system prompts, documents), each request its own ~128-token
    # question and ~128-token answer: what a prefix cache (and cache-aware placement) is for.
    "prefix-sharing": Workload(
        "prefix-sharing", Shape(128, 128, sigma=0.5), max_input=512, max_output=512, prefix_len=2048, groups=8
    ),
}

# Offered rates (requests/s) by model shape, chosen to run from well below to beyond what two
# GPUs serve within the SLOs; `--rates` replaces them. "cpu": the default model at --device cpu.
DEFAULT_RATES: dict[str, dict[str, tuple[float, ...]]] = {
    "1b": {"long-prompt": (4, 8, 16, 32), "chat": (4, 8, 16, 32), "prefix-sharing": (4, 8, 16, 32)},
    "8b": {"long-prompt": (1, 2, 4, 8), "chat": (1, 2, 4, 8), "prefix-sharing": (2, 4, 8, 16)},
    "cpu": {"long-prompt": (0.5, 1), "chat": (0.5, 1), "prefix-sharing": (0.5, 1)},
}


def parse_rates(
    specs: Sequence[str], workloads: Sequence[str], defaults: dict[str, tuple[float, ...]]
) -> dict[str, tuple[float, ...]]:
    """`--rates` values: "R1,R2,..." for every workload or "WORKLOAD=R1,R2,..." for one; the rest
    keep their defaults. Rates come back sorted (the sweep stops at the first saturated one)."""
    out = {w: tuple(defaults[w]) for w in workloads}
    for spec in specs:
        name, sep, values = spec.rpartition("=")
        try:
            rates = tuple(sorted(float(v) for v in values.split(",") if v.strip()))
        except ValueError as exc:
            raise ValueError(f"--rates {spec!r}: rates must be numbers") from exc
        if not rates or any(r <= 0 for r in rates):
            raise ValueError(f"--rates {spec!r}: give positive rates")
        if sep and name not in out:
            raise ValueError(f"--rates {spec!r}: unknown workload {name!r}; one of {', '.join(out)}")
        for w in [name] if sep else list(out):
            out[w] = rates
    return {w: tuple(sorted(r)) for w, r in out.items()}


def requests_per_run(rate: float, duration_s: float, fixed: int | None, least: int = 4) -> int:
    """--requests N, else the arrivals of duration_s at this rate (at least `least`)."""
    return fixed if fixed else max(least, math.ceil(rate * duration_s))


# ----- servers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """One configuration on `gpus` GPUs. kind: pdserve (prefill/decode workers on Ray), vllm
    (data-parallel engines behind one API server) or vllm-pd (vLLM prefill and decode instances
    with NixlConnector behind a proxy)."""

    name: str
    kind: str
    gpus: int
    prefill: int = 0
    decode: int = 0
    args: tuple[str, ...] = ()  # a variant's own `pdserve serve` flags (NAME+VARIANT)

    @property
    def is_vllm(self) -> bool:
        return self.kind.startswith("vllm")


SERVERS: dict[int, tuple[Server, ...]] = {
    2: (
        Server("pdserve-1p1d", "pdserve", 2, prefill=1, decode=1),
        Server("pdserve-colocated", "pdserve", 2, prefill=0, decode=2),
        Server("vllm-dp2", "vllm", 2),
        Server("vllm-1p1d", "vllm-pd", 2, prefill=1, decode=1),
    ),
    4: (
        Server("pdserve-2p2d", "pdserve", 4, prefill=2, decode=2),
        Server("pdserve-3p1d", "pdserve", 4, prefill=3, decode=1),
        Server("pdserve-colocated", "pdserve", 4, prefill=0, decode=4),
        Server("vllm-dp4", "vllm", 4),
    ),
}
OPTIONAL = {"vllm-1p1d"}  # run only when named (--servers) or with --vllm-pd


def select_servers(
    gpus: int, names: Sequence[str] | None, with_optional: bool, variants: Mapping[str, tuple[str, ...]] | None = None
) -> list[Server]:
    """The configurations to run. A name `BASE+VARIANT` is pdserve configuration BASE started
    with the flags `variants[VARIANT]` added (e.g. `pdserve-1p1d+eager`), so that a setting is
    compared on and off within one invocation, on one machine."""
    if gpus not in SERVERS:
        raise ValueError(f"--gpus: {gpus}; one of {', '.join(map(str, SERVERS))}")
    known = {s.name: s for s in SERVERS[gpus]}
    variants = variants or {}
    if not names:
        return [s for s in SERVERS[gpus] if s.name not in OPTIONAL or with_optional]
    unknown = [n for n in names if n.split("+", 1)[0] not in known]
    if unknown:
        raise ValueError(f"--servers: unknown {', '.join(unknown)} for {gpus} GPUs; one of {', '.join(known)}")
    out = []
    for name in names:
        base, _, variant = name.partition("+")
        server = known[base]
        if variant:
            if variant not in variants:
                raise ValueError(f"--servers: {name}: no --variant {variant}=FLAGS given")
            if server.kind != "pdserve":
                raise ValueError(f"--servers: {name}: variants are for pdserve configurations")
            server = replace(server, name=name, args=variants[variant])
        out.append(server)
    return out


def parse_variants(specs: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """`--variant NAME=FLAGS` options (FLAGS one shell-quoted string) as {NAME: flags}."""
    out: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "+" in name or "," in name:
            raise ValueError(f"--variant: {spec!r}; expected NAME=FLAGS, NAME without '+' or ','")
        out[name] = tuple(shlex.split(flags))
    return out


@dataclass(frozen=True)
class LaunchContext:
    """Everything the command lines depend on besides the server itself."""

    python: str  # pdserve's interpreter
    repo: str  # this checkout: on pdserve's PYTHONPATH (bench/, router/, the workers)
    model: str  # model directory
    device: str  # cuda | cpu
    dtype: str  # bfloat16 on GPUs
    max_model_len: int
    gpu_ids: tuple[int, ...] = (0, 1)
    inherited_pythonpath: str = ""  # the PYTHONPATH gpu_serve.py itself runs with
    pdserve_site: str | None = None
    vllm_site: str | None = None
    vllm_python: str | None = None  # None: `python`
    pdserve_args: tuple[str, ...] = ()
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Process:
    name: str  # the log is <out>/logs/<server>.<name>.log
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # set on top of the environment (PYTHONPATH replaced)
    health_url: str | None = None  # GET must answer 200 before the server counts as up
    # Run from the checkout (pdserve) or from the log folder (vLLM: `python -m` puts the working
    # directory first on sys.path, and this checkout's packages must not shadow vLLM's imports).
    in_repo: bool = True


@dataclass(frozen=True)
class Launch:
    server: Server
    processes: tuple[Process, ...]
    url: str  # where the load goes (OpenAI API root)
    admin: str | None = None  # host:port of pdserve's gRPC API (Admin.GetStats); None: not known
    metrics_url: str | None = None  # pdserve's Prometheus /metrics; None: not served


def admin_key(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The key a client sends to pdserve's Admin service, as `pdserve serve` reads it from its
    flags (argv) and environment: (key, None); (None, None) when the service is open; (None,
    why) when it is closed (data keys without an admin key) or not reachable in plain text."""
    def flag(name: str) -> str | None:
        for i, a in enumerate(argv):
            if a == name and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return None

    if flag("--ssl-certfile"):
        return None, "Admin: the server speaks TLS (--ssl-certfile), which these diagnostics do not"
    key = flag("--admin-api-key") or env.get("PDSERVE_ADMIN_API_KEY") or None
    if key:
        return key, None
    if flag("--api-key") or flag("--api-key-file") or env.get("PDSERVE_API_KEY"):
        return None, "Admin: closed (API keys without an admin key)"
    return None, None


def _join_path(*parts: str | None) -> str:
    seen: list[str] = []
    for part in parts:
        for p in (part or "").split(os.pathsep):
            if p and p not in seen:
                seen.append(p)
    return os.pathsep.join(seen)


def pdserve_pythonpath(ctx: LaunchContext) -> str:
    """The checkout, pdserve's site folder and what gpu_serve.py inherited - never vLLM's folder,
    whose pins of shared packages differ from pdserve's."""
    inherited = [p for p in ctx.inherited_pythonpath.split(os.pathsep) if p and p != ctx.vllm_site]
    return _join_path(ctx.repo, ctx.pdserve_site, *inherited)


def vllm_pythonpath(ctx: LaunchContext) -> str:
    """vLLM's site folder alone: nothing of pdserve's (the checkout, its site folder) shadows it."""
    return _join_path(ctx.vllm_site)


VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}


def _flags(flags: dict[str, object]) -> tuple[str, ...]:
    return tuple(x for k, v in flags.items() for x in (k, str(v)))


def launch(server: Server, ctx: LaunchContext, port: int, extra_ports: Sequence[int] = ()) -> Launch:
    """The processes that make up `server`, listening for the OpenAI API on 127.0.0.1:port.
    extra_ports: pdserve's gRPC and /metrics ports (2; without them gRPC takes a free port and
    there is no /metrics), or vllm-pd's prefill and decode instances and their NIXL side
    channels (4)."""
    url = f"http://127.0.0.1:{port}"
    devices = ",".join(str(g) for g in ctx.gpu_ids[: server.gpus])
    if server.kind == "pdserve":
        grpc_port, metrics_port = extra_ports[:2] if len(extra_ports) >= 2 else (0, None)
        flags = {"--model": ctx.model, "--device": ctx.device, "--dtype": ctx.dtype, "--prefill": server.prefill}
        flags |= {"--decode": server.decode, "--port": grpc_port, "--http-port": port}
        flags |= {"--max-model-len": ctx.max_model_len}
        if metrics_port is not None:
            flags["--metrics-port"] = metrics_port
        # -v: the workers' output (their exceptions included) goes to the server's log, which
        # otherwise holds the driver's lines only.
        argv = (ctx.python, "-m", "pdserve.cli", "-v", "serve", *_flags(flags), *ctx.pdserve_args, *server.args)
        env = {"PYTHONPATH": pdserve_pythonpath(ctx), "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
        if ctx.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = devices
        admin = f"127.0.0.1:{grpc_port}" if grpc_port else None
        metrics = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port is not None else None
        return Launch(server, (Process("server", argv, env, url + "/health"),), url, admin, metrics)
    env = VLLM_ENV | {"PYTHONPATH": vllm_pythonpath(ctx)}

    def vllm(p: int, extra: tuple[str, ...]) -> tuple[str, ...]:
        flags = {"--model": ctx.model, "--load-format": "dummy", "--dtype": ctx.dtype}
        flags |= {"--max-model-len": ctx.max_model_len, "--host": "127.0.0.1", "--port": p, "--seed": 0}
        return (
            ctx.vllm_python or "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            *_flags(flags),
            *extra,
            *ctx.vllm_args,
        )

    if server.kind == "vllm":
        argv = vllm(port, ("--data-parallel-size", str(server.gpus)))
        proc = Process("server", argv, env | {"CUDA_VISIBLE_DEVICES": devices}, url + "/health", in_repo=False)
        return Launch(server, (proc,), url)
    if server.kind == "vllm-pd":
        if len(extra_ports) < 4:
            raise ValueError("vllm-pd: needs 4 extra ports (prefill, decode, two NIXL side channels)")
        p_port, d_port, p_side, d_side = extra_ports[:4]
        kv = ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}))

        def instance(name: str, gpu: int, p: int, side: int) -> Process:
            nixl = {"UCX_NET_DEVICES": "all", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
            env_ = env | nixl | {"CUDA_VISIBLE_DEVICES": str(gpu)}
            return Process(name, vllm(p, kv), env_, f"http://127.0.0.1:{p}/health", in_repo=False)

        proxy = (ctx.python, str(Path(ctx.repo) / "bench" / "vllm_pd_proxy.py"), "--port", str(port))
        proxy += ("--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}")
        procs = (
            instance("prefill", ctx.gpu_ids[0], p_port, p_side),
            instance("decode", ctx.gpu_ids[1], d_port, d_side),
            Process("proxy", proxy, {"PYTHONPATH": pdserve_pythonpath(ctx)}, url + "/health"),
        )
        return Launch(server, procs, url)
    raise ValueError(f"server kind: unknown {server.kind!r}")


# ----- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    launches: tuple[Launch, ...]
    workloads: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]
    duration_s: float
    requests: int | None  # fixed requests per run, else rate * duration_s
    scale: float

    def runs(self) -> list[tuple[str, str, float, int]]:
        """(server, workload, rate, requests) in the order they run: each server once, every
        workload and rate against it."""
        return [
            (lc.server.name, w, r, requests_per_run(r, self.duration_s, self.requests))
            for lc in self.launches
            for w in self.workloads
            for r in self.rates[w]
        ]

    def estimate_s(self, startup_s: float = 60.0, drain_s: float = 2.5, warmup_s: float = 3.0) -> float:
        """Seconds the whole invocation should take with no rate saturated: each server's start and
        warm-up, then every run's arrivals plus the time its last requests take to finish."""
        total = 0.0
        for lc in self.launches:
            total += startup_s + warmup_s * len(self.workloads) + 5.0  # 5: stopping it
        for _, _, rate, n in self.runs():
            total += n / rate + drain_s
        return total


def describe(plan: Plan, out: Path) -> str:
    """The plan as text: each server's processes and environment, the workloads and rates."""
    lines = [f"output: {out}", f"workloads (scale {plan.scale:g}):"]
    for w in plan.workloads:
        spec = WORKLOADS[w]
        prefix = f"{spec.groups} shared prefixes of {round(spec.prefix_len * plan.scale)} + " if spec.prefix_len else ""
        lines.append(
            f"  {w}: {prefix}prompt median {round(spec.shape.input_median * plan.scale)}, output median "
            f"{round(spec.shape.output_median * plan.scale)} tokens; rates {', '.join(f'{r:g}' for r in plan.rates[w])} req/s"
        )
    for lc in plan.launches:
        lines.append(f"server {lc.server.name} ({lc.server.gpus} GPUs), load on {lc.url}:")
        for p in lc.processes:
            env = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))
            lines.append(f"  [{p.name}] {env} {shlex.join(p.argv)}")
    runs = plan.runs()
    lines.append(
        f"{len(runs)} runs, {sum(n for *_, n in runs)} requests; about {plan.estimate_s() / 60:.1f} min "
        "(60 s a server start-up, 2.5 s for a run's last requests; longer where a rate saturates)"
    )
    return "\n".join(lines)
