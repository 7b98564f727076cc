"""The `pdserve` command."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from pdserve import cli_flags as flags
from pdserve.cluster.node_pools import PlacementError
from pdserve.cluster.local_ray import prepare as prepare_local_ray
from pdserve.cluster.ports import PortInUseError
from pdserve.cluster.ray_address import one_machine_env
from pdserve.engine.args import EngineArgs, engine_options


# router.placement.placement_config.POLICIES, spelled out so that --help imports nothing of the router. The
# baselines (round_robin, random, modulo) are the trace benchmark's: `pdserve bench router`.
PLACEMENT_POLICIES = ("index", "ring")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text for prompts with the offline engine",
        description="Generate a completion for each PROMPT. With --chat (the default for models with a chat "
        "template) each prompt is sent as one user message.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    flags.add_engine_args(gen)
    gen.add_argument(
        "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1, metavar="N",
        help="split the model over N ranks, one process each (on CUDA one GPU each, run without CUDA graphs; default: 1)",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    gen.add_argument(
        "--temperature", type=float, default=0.0,
        help="0 is greedy (default: 0, here and with --address; a gRPC or HTTP request that sets no "
        "temperature gets temperature 1.0, the OpenAI convention)",
    )
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    chat = gen.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="apply the chat template")
    chat.add_argument("--raw", dest="chat", action="store_false", help="send prompts as plain text")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument(
        "--address", default=None, metavar="HOST:PORT",
        help="send the prompts to a running `pdserve serve` and stream the answers (default: run the engine here)",
    )
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline per request with --address, seconds")
    flags.add_client_security_args(gen)

    srv = sub.add_parser(
        "serve",
        help="start a disaggregated cluster (prefill + decode pools on Ray), or a colocated one, and its gRPC API",
        description="Start (or join, with --address) a Ray cluster, the prefill and decode worker pools and the "
        "router's gRPC server; print the address once ready; stop cleanly on SIGINT/SIGTERM. With --prefill 0 the "
        "cluster is colocated: each decode worker prefills its own requests and no KV moves between workers. "
        "A gRPC or HTTP request that sets no temperature samples at temperature 1.0 (the OpenAI convention), "
        "while `pdserve generate` defaults to 0 (greedy): send temperature 0 for repeatable answers.",
    )
    flags.add_engine_args(srv)
    srv.add_argument(
        "--prefill", type=int, default=1,
        help="prefill workers (default: 1); 0 serves colocated: the decode workers prefill their own requests",
    )
    srv.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    srv.add_argument(
        "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1, metavar="N",
        help="ranks per worker of both pools, one process each (on CUDA one GPU each); the KV moves between any two "
        "widths (default: 1)",
    )
    for role in ("prefill", "decode"):
        srv.add_argument(
            f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
            help=f"ranks per {role} worker (default: --tensor-parallel-size)",
        )
    srv.add_argument(
        "--max-local-prefill-tokens", type=int, default=0, metavar="N",
        help="conditional disaggregation: prefill a prompt on its decode worker when at most N of its tokens are "
        "missing from that worker's prefix cache (default: 0, always use the prefill pool)",
    )
    srv.add_argument(
        "--max-prefill-queue-tokens", type=int, default=0, metavar="N",
        help="overflow: prefill a prompt on its decode worker when every prefill worker has N or more tokens of "
        "prefill in flight, so that past the prefill pool's rate the decode workers take the excess instead of the "
        "queue growing; pair it with --itl-target-ms (or --max-prefill-tokens-with-decodes): without either a decode "
        "worker prefills an overflowed prompt in one step, and its running streams wait for it (default: 0, never)",
    )
    flags.add_edge_args(srv)
    srv.add_argument(
        "--routers", type=int, default=1, metavar="N",
        help="router processes on this host, sharing the gRPC and HTTP ports (SO_REUSEPORT spreads connections over "
        "them), as vLLM runs an API server per data-parallel rank: a router's one event loop relays every token of "
        "its streams, so one process caps the tokens/s a fleet can stream (default: 1; /metrics on the first)",
    )
    srv.add_argument(
        "--address", default=None, metavar="RAY_ADDRESS",
        help="join this Ray cluster (HOST:PORT, or auto: RAY_ADDRESS or the cluster `ray start` last started here) "
        "instead of starting one; without it this command starts a Ray instance of its own, whatever else runs on "
        "the host",
    )
    srv.add_argument(
        "--keep-workers", action="store_true",
        help="on SIGTERM or Ctrl-C stop only this router and leave the worker actors serving in the Ray cluster, for "
        "other routers and for the next `pdserve serve --address`, which adopts them without loading a model "
        "(default: off, the stop also stops the pools' workers, adopted ones included); needs --address",
    )
    srv.add_argument(
        "--ray-temp-dir", default=None, metavar="DIR",
        help="the temp directory (sockets, logs, token) of the Ray instance this command starts (default: a new "
        "one under the system temp folder, removed at exit)",
    )
    srv.add_argument("--lease-s", type=float, default=30.0, help="how long a prefill worker holds KV for a pull (default: 30)")
    srv.add_argument(
        "--kv-checksum", action=argparse.BooleanOptionalAction, default=True,
        help="a checksum per KV block, checked by the decode worker after each transfer; a mismatch recomputes the "
        "prompt (default: on; --no-kv-checksum saves a pass over each prompt's KV on both workers)",
    )
    srv.add_argument(
        "--kv-transfer-overlap", action="store_true",
        help="the decode worker pulls a prompt's KV chunk by chunk while the prompt is still being prefilled, so "
        "that little is left to move after the prefill (default: off; see docs/kv-transfer.md)",
    )
    srv.add_argument(
        "--placement-policy", choices=PLACEMENT_POLICIES, default="index",
        help="how prompts are placed on prefill workers: index (consistent-hash ring with bounded loads "
        "plus the workers' prefix caches, the default) or ring (without the prefix index); see docs/router.md",
    )
    srv.add_argument(
        "--load-factor", type=float, default=1.25, metavar="C",
        help="bounded loads: a worker takes new work only while below C x the pool's mean load (default: 1.25)",
    )
    srv.add_argument(
        "--cpu-threads", type=int, default=None, metavar="N",
        help="CPU workers: torch threads each (default: this host's cores shared out among the workers, one left "
        "to the router when there are more cores than workers)",
    )
    flags.add_controller_args(srv)
    flags.add_telemetry_args(srv)
    flags.add_security_args(srv)
    srv.add_argument(
        "--kv-net-devices", default=None, metavar="DEVS",
        help="network devices of the workers' KV transfers, as UCX_NET_DEVICES (default: lo for a local cluster, "
        "UCX's choice with --address); this network is not authenticated: keep it isolated",
    )
    srv.add_argument(
        "--token-transport", choices=("socket", "ray"), default="socket",
        help="how routers poll decode workers for tokens: socket, a TCP connection to each worker on its node's "
        "address, opened with a per-worker key handed over Ray (far less CPU a poll); ray, a Ray actor call a poll "
        "(default: socket)",
    )
    srv.add_argument(
        "--router-lease-s", type=float, default=15.0, metavar="S",
        help="a decode worker aborts the requests of a router (this one or a `pdserve router`) that has not polled "
        "it for S seconds, freeing their KV blocks (default: 15)",
    )

    rtr = sub.add_parser(
        "router",
        help="another router for a running cluster: no single point of failure in front of the workers",
        description="Join the worker pools that `pdserve serve` or deploy/ray/launch.sh started on the Ray cluster at "
        "--address and serve the same gRPC, HTTP and metrics APIs in front of them. Run several behind a load "
        "balancer: each finds the workers by name, learns their model and settings from them, and follows workers "
        "that join or leave. A router that dies loses only its own streams; the workers abort its requests once it "
        "has not polled them for --router-lease-s of `serve`. Ray's token must be at hand as for any Ray client "
        "(RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH; docs/operations.md); `pdserve serve` prints "
        "the whole command, token path included.",
    )
    rtr.add_argument(
        "--address", required=True, metavar="RAY_ADDRESS",
        help="the Ray cluster the workers run on: HOST:PORT (`pdserve serve` prints it) or auto (RAY_ADDRESS, or "
        "the cluster `ray start` last started on this host)",
    )
    rtr.add_argument(
        "--model", default=None, metavar="DIR",
        help="the model directory on this host, for the tokenizer (default: the directory the workers report)",
    )
    flags.add_edge_args(rtr)
    flags.add_telemetry_args(rtr)
    flags.add_security_args(rtr)

    _add_control_parsers(sub)

    bench = sub.add_parser("bench", help="benchmarks that need no GPU", description="Benchmarks that need no GPU.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    benchmarks = {
        "router": (
            "replay a trace against the router's placement policies with simulated workers",
            "Replay a JSONL trace ({t, input_ids, output_len[, session]} a line; write one with "
            "`python bench/traces.py`) against the router's placement policy with simulated prefill workers; "
            "report prefix hit rate against the ideal, load balance, remapping and TTFT.",
        ),
        "serve": (
            "load an OpenAI-compatible server and report latency, throughput and goodput",
            "Send a workload (synthetic chat/rag/codegen lengths or a trace) to any OpenAI-compatible "
            "server over streamed /v1/completions, as Poisson arrivals or at fixed concurrency; report TTFT, ITL and "
            "end-to-end latency percentiles, tokens/s and goodput under SLOs as JSON; with --sweep, a latency-throughput curve.",
        ),
    }
    for name, (summary, description) in benchmarks.items():
        sp = bench_sub.add_parser(name, help=summary, description=description)
        module = _bench_module(name)
        if module is None:
            sp.set_defaults(bench_missing=True)
        else:
            module.add_arguments(sp)
    return parser


def _add_control_parsers(sub: argparse._SubParsersAction) -> None:
    from pdserve.control import sim_commands as control

    sim = sub.add_parser(
        "simulate",
        help="replay a trace in the P:D simulator, with a static split, the controller or colocated workers",
        description="Replay a JSONL trace in the discrete-event simulator: the router's placement policies, "
        "simulated workers from a performance model, and a static prefill:decode split, the P:D controller or "
        "every worker colocated (docs/controller.md). Reports goodput, SLO attainment, latencies and role changes.",
    )
    control.add_simulate_arguments(sim)
    plan = sub.add_parser(
        "plan",
        help="choose disaggregated or colocated for a trace: every split, the controller and colocated",
        description="Simulate every static prefill:decode split of a GPU budget (--gpus, workers of each pool's "
        "tensor-parallel width; or --workers at width 1), the controller and colocated workers on the same GPUs on a "
        "trace; print each with its goodput per GPU, the controller's goodput against the best static split, and "
        "which to run for this trace and SLO, the best split or colocated.",
    )
    control.add_plan_arguments(plan)


def _bench_module(name: str) -> ModuleType | None:
    """bench/ lives next to the package in a source checkout; it is not installed."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / f"{name}.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.append(str(root))
    return importlib.import_module(f"bench.{name}")


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.address:
        from pdserve.client import generate_remote

        return generate_remote(args)
    from pdserve import LLM, SamplingParams
    from pdserve import offline_generate as offline

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        **engine_options(EngineArgs.from_options(vars(args))),
    )
    use_chat = args.chat
    if use_chat is None:
        use_chat = llm.tokenizer is not None and bool(getattr(llm.tokenizer, "chat_template", None))
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) if use_chat else p for p in args.prompts]
    progress = offline.Progress(sys.stderr, len(prompts))
    outputs, interrupted = offline.generate(llm.engine, prompts, params, progress)
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    if interrupted:
        print("pdserve: interrupted; above is what was generated until then", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "serve":
            # Ray reads its environment once, when it is imported: the one-machine mode (every Ray
            # listener on loopback, not the host's external address), and for a Ray instance of
            # this server's own, its token and ports. Set afterwards it has no effect.
            os.environ.update(one_machine_env(args.address, os.environ))
            local = None
            if args.address is not None and args.ray_temp_dir is not None:
                raise ValueError("--ray-temp-dir: only for the Ray instance this command starts, not with --address")
            if args.address is None:
                local = prepare_local_ray(args.ray_temp_dir, os.environ)
                os.environ.update(local.environment())
            from pdserve.cluster.main import serve_forever

            return serve_forever(args, local)
        if args.command == "router":
            os.environ.update(one_machine_env(args.address, os.environ))  # a cluster on loopback: see serve
            from pdserve.cluster.main import route_forever

            return route_forever(args)
        if args.command in ("simulate", "plan"):
            from pdserve.control import sim_commands as control

            return control.run_simulate(args) if args.command == "simulate" else control.run_plan(args)
        if args.command == "bench":
            if getattr(args, "bench_missing", False):
                raise ImportError("bench: the benchmarks come with a source checkout of pdserve, not with the package")
            module = _bench_module(args.bench)
            assert module is not None
            return module.run(args)
    except (ValueError, ImportError, FileNotFoundError, PortInUseError, PlacementError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before anything was generated (a model still loading)
        print("pdserve: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
