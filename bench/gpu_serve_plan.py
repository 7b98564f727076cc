"""What `bench/gpu_serve.py` runs, as data: the server configurations and the command lines that
start them, the plan of one invocation, how long it should take and how to split it into calls
that each fit a time limit. Pure: no process is started and no file is read here.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.gpu_serve_workloads import WORKLOADS, requests_per_run

# ----- servers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """One configuration on `gpus` GPUs. kind: pdserve (prefill/decode workers on Ray), vllm
    (`vllm serve --data-parallel-size N`: N engines, one API server per engine, as vLLM's users
    start it), vllm-apiserver (the same engines behind ONE API server process, the
    `vllm.entrypoints.openai.api_server` module: a weaker baseline, kept to show the difference)
    or vllm-pd (`vllm serve` prefill and decode instances with NixlConnector behind a proxy).
    Widths: pdserve's prefill_tp and decode_tp ranks (GPUs) per worker of each pool; vLLM's tp
    GPUs per engine and dp engines (None: as many as the GPUs hold)."""

    name: str
    kind: str
    gpus: int
    prefill: int = 0
    decode: int = 0
    args: tuple[str, ...] = ()  # a variant's own `pdserve serve` flags (NAME+VARIANT)
    prefill_tp: int = 1
    decode_tp: int = 1
    tp: int = 1
    dp: int | None = None

    @property
    def is_vllm(self) -> bool:
        return self.kind.startswith("vllm")

    @property
    def data_parallel(self) -> int:
        """vLLM's engines: dp, else one per tp GPUs."""
        return self.dp if self.dp is not None else self.gpus // self.tp

    @property
    def gpus_used(self) -> int:
        """The GPUs the configuration's workers or engines take, by their widths."""
        if self.kind in ("vllm", "vllm-apiserver"):
            return self.tp * self.data_parallel
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


SERVERS: dict[int, tuple[Server, ...]] = {
    # One GPU: no disaggregation to compare, but the serving path (router, engine loop, mixed
    # steps) against `vllm serve` on the same card, at half the 2-GPU rates.
    1: (
        Server("pdserve-colocated", "pdserve", 1, prefill=0, decode=1),
        Server("vllm-serve-dp1", "vllm", 1),
    ),
    2: (
        Server("pdserve-1p1d", "pdserve", 2, prefill=1, decode=1),
        Server("pdserve-colocated", "pdserve", 2, prefill=0, decode=2),
        Server("vllm-serve-dp2", "vllm", 2),
        Server("vllm-serve-1p1d", "vllm-pd", 2, prefill=1, decode=1),
        Server("vllm-apiserver-dp2", "vllm-apiserver", 2),
    ),
    4: (
        Server("pdserve-2p2d", "pdserve", 4, prefill=2, decode=2),
        Server("pdserve-3p1d", "pdserve", 4, prefill=3, decode=1),
        Server("pdserve-colocated", "pdserve", 4, prefill=0, decode=4),
        Server("vllm-serve-dp4", "vllm", 4),
        Server("vllm-apiserver-dp4", "vllm-apiserver", 4),
        # Tensor parallel (profile tp-8b): a TP2 prefill worker feeding two TP1 decode workers,
        # against two colocated TP2 workers and vLLM's TP2 x DP2.
        Server("pdserve-1p2d-tp2", "pdserve", 4, prefill=1, decode=2, prefill_tp=2, decode_tp=1),
        Server("pdserve-colocated-tp2", "pdserve", 4, prefill=0, decode=2, prefill_tp=2, decode_tp=2),
        Server("vllm-serve-tp2dp2", "vllm", 4, tp=2, dp=2),
    ),
}
OPTIONAL = {"vllm-serve-1p1d"}  # run only when named (--servers) or with --vllm-pd
# Run only when named in --servers (or by a profile that names them).
NAMED_ONLY = {
    "vllm-apiserver-dp2", "vllm-apiserver-dp4", "pdserve-1p2d-tp2", "pdserve-colocated-tp2", "vllm-serve-tp2dp2"
}  # fmt: skip


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
        return [s for s in SERVERS[gpus] if s.name not in NAMED_ONLY and (s.name not in OPTIONAL or with_optional)]
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
    # pdserve's --load-format: "dummy" where the model directory is a random shape's config and
    # tokenizer alone (random weights drawn at start-up, as vLLM's --load-format dummy draws them).
    load_format: str = "auto"
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


def vllm_argv(ctx: LaunchContext, port: int, extra: tuple[str, ...], api_server_module: bool = False) -> tuple[str, ...]:
    """`vllm serve MODEL ...` as its users run it (`python -m vllm.entrypoints.cli.main serve`):
    vLLM's own defaults for the card (memory share, batch limits, CUDA graphs, api_server_count =
    data-parallel size), only what a random-weight model directory needs (--load-format dummy,
    --max-model-len) and where to listen. api_server_module: the one-API-server module instead,
    with the same flags (`--model MODEL`)."""
    flags = {"--load-format": "dummy", "--max-model-len": ctx.max_model_len, "--host": "127.0.0.1", "--port": port}
    python = ctx.vllm_python or "python"
    if api_server_module:
        head: tuple[str, ...] = (python, "-m", "vllm.entrypoints.openai.api_server", "--model", ctx.model)
    else:
        head = (python, "-m", "vllm.entrypoints.cli.main", "serve", ctx.model)
    return (*head, *_flags(flags), *extra, *ctx.vllm_args)


def _pdserve_widths(server: Server) -> dict[str, object]:
    """`pdserve serve`'s width flags: none at width 1 (its default), one for both pools where
    they are equal or the cluster is colocated, else one per pool."""
    if server.prefill == 0 or server.prefill_tp == server.decode_tp:
        return {} if server.decode_tp == 1 else {"--tensor-parallel-size": server.decode_tp}
    return {"--prefill-tensor-parallel-size": server.prefill_tp, "--decode-tensor-parallel-size": server.decode_tp}


def launch(server: Server, ctx: LaunchContext, port: int, extra_ports: Sequence[int] = ()) -> Launch:
    """The processes that make up `server`, listening for the OpenAI API on 127.0.0.1:port.
    extra_ports: pdserve's gRPC and /metrics ports (2; without them gRPC takes a free port and
    there is no /metrics), or vllm-pd's prefill and decode instances and their NIXL side
    channels (4)."""
    if server.gpus_used != server.gpus:
        raise ValueError(f"{server.name}: its workers' widths take {server.gpus_used} GPUs, not {server.gpus}")
    url = f"http://127.0.0.1:{port}"
    devices = ",".join(str(g) for g in ctx.gpu_ids[: server.gpus])
    if server.kind == "pdserve":
        grpc_port, metrics_port = extra_ports[:2] if len(extra_ports) >= 2 else (0, None)
        flags = {"--model": ctx.model, "--device": ctx.device, "--dtype": ctx.dtype, "--prefill": server.prefill}
        flags |= {"--decode": server.decode, "--port": grpc_port, "--http-port": port}
        flags |= {"--max-model-len": ctx.max_model_len}
        if ctx.load_format != "auto":
            flags["--load-format"] = ctx.load_format
        if metrics_port is not None:
            flags["--metrics-port"] = metrics_port
        flags |= _pdserve_widths(server)
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
    if server.kind in ("vllm", "vllm-apiserver"):
        tp = ("--tensor-parallel-size", str(server.tp)) if server.tp != 1 else ()
        dp = (*tp, "--data-parallel-size", str(server.data_parallel))
        argv = vllm_argv(ctx, port, dp, api_server_module=server.kind == "vllm-apiserver")
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
            return Process(name, vllm_argv(ctx, p, kv), env_, f"http://127.0.0.1:{p}/health", in_repo=False)

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

# Seconds from a server's start to its health (vLLM: ~75 s on an H100 for a 1B model, about half
# of it Python imports), and to stop it.
STARTUP_S = {"pdserve": 75.0, "vllm": 90.0, "vllm-apiserver": 90.0, "vllm-pd": 120.0}
STOP_S = 15.0
WARMUP_S = 3.0  # a workload's warm-up requests
DRAIN_S = 2.5  # a run's last requests, where the rate is served
ENGINE_LOAD_S = 90.0  # the engine-step child: start, load, CUDA graphs
ENGINE_BATCH_S = 4.0  # one batch size: its top-up prompts' prefill and the timed steps


@dataclass(frozen=True)
class Plan:
    launches: tuple[Launch, ...]
    workloads: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]
    duration_s: float
    requests: int | None  # fixed requests per run, else rate * duration_s
    scale: float
    request_timeout_s: float = 30.0
    engine_steps: bool = False  # time the engine's decode step after the servers
    repeats: int = 1  # runs per (workload, rate), each with its own prompts
    refine: int = 0  # more rates per workload and server, bisecting where SLO attainment fell

    def runs(self) -> list[tuple[str, str, float, int]]:
        """(server, workload, rate, requests) in the order they run: each server once, every
        workload and rate against it."""
        return [run for lc in self.launches for run in self.server_runs(lc)]

    def server_runs(self, lc: Launch) -> list[tuple[str, str, float, int]]:
        """The runs planned for one server; a refining run is counted at its workload's middle
        rate (which rates it runs depends on the runs before it)."""
        return [
            (lc.server.name, w, r, requests_per_run(r, self.duration_s, self.requests))
            for w in self.workloads
            for r in (*self.rates[w], *[statistics.median(self.rates[w])] * self.refine)
            for _ in range(self.repeats)
        ]

    def server_s(self, lc: Launch, worst: bool = False) -> float:
        """Seconds one server takes: start, warm-up, every run's arrivals and its last requests
        (worst: each run's last requests take the whole request timeout), stop."""
        total = STARTUP_S.get(lc.server.kind, 90.0) + WARMUP_S * len(self.workloads) + STOP_S
        tail = self.request_timeout_s if worst else DRAIN_S
        return total + sum(n / rate + tail for _, _, rate, n in self.server_runs(lc))

    def engine_s(self, launches: tuple[Launch, ...] | None = None) -> float:
        """The engine-step phase: a batch size per decode worker and run of the pdserve servers."""
        pd = [lc for lc in (self.launches if launches is None else launches) if lc.server.kind == "pdserve"]
        if not self.engine_steps or not pd:
            return 0.0
        batches = sum(max(1, lc.server.decode) * len(self.server_runs(lc)) for lc in pd)
        return ENGINE_LOAD_S + ENGINE_BATCH_S * batches

    def estimate_s(self, worst: bool = False) -> float:
        """Seconds the whole invocation should take (worst: every run's last requests time out)."""
        return sum(self.server_s(lc, worst) for lc in self.launches) + self.engine_s()

    def split(self, budget_s: float) -> list[tuple[tuple[str, ...], float]]:
        """Servers grouped, in order, into calls that each should fit budget_s; each group with
        its estimate (the engine-step phase goes with the pdserve servers' group). A server that
        alone exceeds the budget is a group of its own."""
        groups: list[list[Launch]] = []
        for lc in self.launches:
            if groups and self._group_s([*groups[-1], lc]) <= budget_s:
                groups[-1].append(lc)
            else:
                groups.append([lc])
        return [(tuple(lc.server.name for lc in g), self._group_s(g)) for g in groups]

    def _group_s(self, group: list[Launch]) -> float:
        return sum(self.server_s(lc) for lc in group) + self.engine_s(tuple(group))


def describe(plan: Plan, out: Path, budget_s: float | None = None) -> str:
    """The plan as text: each server's processes and environment, the workloads and rates, the
    time it should take and, where that is over budget_s, how to split it into calls."""
    lines = [f"output: {out}", f"workloads (scale {plan.scale:g}):"]
    for w in plan.workloads:
        spec = WORKLOADS[w]
        prefix = f"{spec.groups} shared prefixes of {round(spec.prefix_len * plan.scale)} + " if spec.prefix_len else ""
        lines.append(
            f"  {w}: {prefix}prompt median {round(spec.shape.input_median * plan.scale)}, output median "
            f"{round(spec.shape.output_median * plan.scale)} tokens; rates {', '.join(f'{r:g}' for r in plan.rates[w])} req/s"
        )
    for lc in plan.launches:
        lines.append(f"server {lc.server.name} ({lc.server.gpus} GPUs, ~{plan.server_s(lc):.0f} s), load on {lc.url}:")
        for p in lc.processes:
            env = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))
            lines.append(f"  [{p.name}] {env} {shlex.join(p.argv)}")
    runs = plan.runs()
    engine = f", engine steps ~{plan.engine_s():.0f} s" if plan.engine_s() else ""
    lines.append(
        f"{len(runs)} runs, {sum(n for *_, n in runs)} requests; about {plan.estimate_s() / 60:.1f} min{engine} "
        f"(start-ups {', '.join(f'{k} {v:g} s' for k, v in STARTUP_S.items())}; {DRAIN_S:g} s for a run's last "
        f"requests), at most {plan.estimate_s(worst=True) / 60:.1f} min if every run's last requests take the "
        f"{plan.request_timeout_s:g} s request timeout"
    )
    if budget_s is not None and plan.estimate_s() > budget_s:
        lines.append(f"over the {budget_s:g} s budget; in calls of {budget_s:g} s each (same --out folder name, then "
                     "--report-only over their files together):")  # fmt: skip
        for k, (names, secs) in enumerate(plan.split(budget_s), 1):
            lines.append(f"  call {k}: --servers {','.join(names)}  (~{secs:.0f} s)")
    return "\n".join(lines)
