"""The flag groups the `pdserve` sub-commands share: engine, telemetry, security, the router's
listeners and admission, a client's TLS, and the P:D controller."""

from __future__ import annotations

import argparse

from pdserve.engine.args import (
    ATTENTION_BACKENDS, CPU_LIMITS, LARGE_GPU_LIMITS, LOAD_FORMATS, SMALL_GPU_LIMITS, EngineArgs,
)
from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.limits import InputLimits
from pdserve.router.edge.tool_parsers import PARSERS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    # EngineArgs' fields, one flag each, dest = the field's name: EngineArgs.from_options(vars(args))
    # reads them. An unset flag leaves no attribute (SUPPRESS), so the dataclass default applies.
    d, unset = EngineArgs(), argparse.SUPPRESS
    p.add_argument(
        "--num-kv-blocks", dest="num_kv_blocks", type=int, default=unset, metavar="N",
        help="KV pool size in blocks (default: from free memory)",
    )
    p.add_argument(
        "--block-size", dest="block_size", type=int, default=unset, metavar="N",
        help=f"tokens per KV block (default: {d.block_size})",
    )
    p.add_argument(
        "--max-num-seqs", dest="max_num_seqs", type=int, default=unset, metavar="N",
        help=f"sequences batched per step (default: from the device: {CPU_LIMITS.max_num_seqs} on CPU, "
        f"{LARGE_GPU_LIMITS.max_num_seqs} on a GPU of 70 GiB or more, {SMALL_GPU_LIMITS.max_num_seqs} on a smaller one)",
    )
    p.add_argument(
        "--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, default=unset, metavar="N",
        help=f"token budget per step; longer prompts are chunked (default: from the device: "
        f"{LARGE_GPU_LIMITS.max_num_batched_tokens} on a GPU of 70 GiB or more, {CPU_LIMITS.max_num_batched_tokens} elsewhere)",
    )
    p.add_argument(
        "--max-prefill-tokens-with-decodes", dest="max_prefill_tokens_with_decodes", type=int, default=unset,
        metavar="N",
        help="prompt tokens in a step that also decodes: a worker that prefills beside running sequences "
        "(colocated, or taking prompts from a busy prefill pool, see --max-prefill-queue-tokens) chunks them so, "
        "which keeps those sequences' inter-token time near a decode step's (default: up to --max-num-batched-tokens)",
    )
    p.add_argument(
        "--itl-target-ms", dest="itl_target_ms", type=float, default=unset, metavar="MS",
        help="a step-time target for steps that decode: from its measured step costs, a worker puts prompt tokens "
        "beside its running sequences only as far as the steps' mean stays within MS (decode steps under MS save up "
        "for a chunk; a worker over MS still gives a waiting prompt 16 tokens every 8 steps); with "
        "--max-prefill-tokens-with-decodes, also at most that many a step (default: off)",
    )
    p.add_argument(
        "--max-model-len", dest="max_model_len", type=int, default=unset, metavar="N",
        help="cap the context length (default: the model's)",
    )
    p.add_argument(
        "--attention-backend", dest="attention_backend", default=unset, choices=ATTENTION_BACKENDS,
        help=f"attention kernels: flash (flash-attn; CUDA, 16-bit) or torch (SDPA) (default: {d.attention_backend}: "
        "flash where it can run, else torch)",
    )
    p.add_argument(
        "--triton-decode", dest="triton_decode_kernels", action=argparse.BooleanOptionalAction, default=unset,
        help="GPU: decode through pdserve's Triton kernels (split-KV attention; batch-1 matmuls with the "
        "norms and the greedy pick fused). Default: on wherever Triton imports; see docs/benchmarks.md",
    )
    p.add_argument(
        "--prefill-cuda-graphs", dest="prefill_cuda_graphs", action=argparse.BooleanOptionalAction, default=unset,
        help="GPU: run prefill and mixed steps as CUDA graphs of everything but attention, by token count "
        "(default: on wherever decode steps are CUDA graphs)",
    )
    p.add_argument(
        "--enforce-eager", dest="use_cuda_graphs", action="store_false", default=unset,
        help="GPU: run every step eagerly, recording no CUDA graphs (default: decode steps as CUDA graphs, "
        "at every tensor-parallel width)",
    )
    p.add_argument(
        "--load-format", dest="load_format", default=unset, choices=LOAD_FORMATS,
        help="auto: the model's safetensors; dummy: random weights of its shape, from its config.json alone, "
        f"for benchmarks (default: {d.load_format})",
    )


def add_telemetry_args(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that the standard OTEL_* variables apply unless a flag is given.
    p.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT",
        help="serve Prometheus /metrics on this port: the router's figures and every worker's (default: off)",
    )
    p.add_argument(
        "--export-worker-metrics", action=argparse.BooleanOptionalAction, default=True,
        help="put every worker's series on this router's /metrics; with several routers, leave it on in one "
        "only, so that each worker is counted once (default: on)",
    )
    p.add_argument(
        "--trace-exporter", default=None, choices=["none", "console", "otlp-grpc", "otlp-http"],
        help="where request traces go (default: from OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_PROTOCOL, else none)",
    )
    p.add_argument(
        "--trace-endpoint", default=None, metavar="URL",
        help="OTLP endpoint: host:port for otlp-grpc, http://host:port/v1/traces for otlp-http "
        "(default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else the exporter's default)",
    )
    p.add_argument(
        "--trace-sample-ratio", type=float, default=None, metavar="R",
        help="share of requests traced, 0..1 (default: OTEL_TRACES_SAMPLER[_ARG], else 1)",
    )


def add_security_args(p: argparse.ArgumentParser) -> None:
    # vLLM's flag names; docs/security.md says what each listener needs.
    p.add_argument(
        "--ssl-certfile", default=None, metavar="PEM", help="serve gRPC and HTTP over TLS with this certificate (chain)"
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the private key of --ssl-certfile")
    p.add_argument(
        "--ssl-ca-certs", default=None, metavar="PEM",
        help="mutual TLS: clients must present a certificate signed by one of these CAs. "
        "The three files are read again when they change (rotation without a restart)",
    )
    p.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require 'authorization: Bearer KEY' on gRPC and HTTP calls, health checks excepted (repeatable; "
        "also PDSERVE_API_KEY, comma-separated)",
    )
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="more API keys, one a line")
    p.add_argument(
        "--require-api-key", action="store_true",
        help="refuse to start when --host is not a loopback address and no data-plane key (--api-key, "
        "--api-key-file or PDSERVE_API_KEY) is set; without it such a start only warns",
    )
    p.add_argument(
        "--admin-api-key", default=None, metavar="KEY",
        help="the key of the Admin service (also PDSERVE_ADMIN_API_KEY); data keys are refused there, and with "
        "--api-key set but no admin key the Admin service is closed",
    )
    limits = InputLimits()  # the defaults live there, once
    p.add_argument(
        "--max-request-bytes", type=int, default=limits.max_request_bytes, metavar="N",
        help=f"largest request body or gRPC message (default: {limits.max_request_bytes // 2**20} MiB)",
    )
    p.add_argument(
        "--max-prompt-chars", type=int, default=limits.max_prompt_chars, metavar="N",
        help=f"longest prompt text (default: {limits.max_prompt_chars})",
    )
    p.add_argument(
        "--max-stop-strings", type=int, default=limits.max_stop_strings, metavar="N",
        help=f"stop strings per request (default: {limits.max_stop_strings})",
    )
    p.add_argument(
        "--max-stop-chars", type=int, default=limits.max_stop_chars, metavar="N",
        help=f"longest stop string (default: {limits.max_stop_chars})",
    )


def add_edge_args(p: argparse.ArgumentParser) -> None:
    """The router's listeners and admission: `serve` and `router` take the same."""
    p.add_argument(
        "--max-queued-requests", type=int, default=0, metavar="N",
        help="bounded admission: each pool (prefill, decode) holds at most N requests admitted but without a token "
        "yet; more are refused at once with RESOURCE_EXHAUSTED / HTTP 429 and a retry hint (default: 0, unbounded)",
    )
    p.add_argument(
        "--poll-interval-ms", type=float, default=0.0, metavar="MS",
        help="poll each decode worker for tokens at most once per MS: fewer, fuller polls (each costs the router "
        "about the same CPU whatever it carries) for up to MS of added token latency (default: 0, every step)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051; 0 picks a free one)")
    p.add_argument(
        "--http-port", type=int, default=None, metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port",
    )
    http = HttpOptions()  # the defaults live there, once
    p.add_argument(
        "--timeout-keep-alive", type=float, default=http.keep_alive_s, metavar="S",
        help=f"close an HTTP connection idle this long, before its first request or after an answer "
        f"(default: {http.keep_alive_s:g})",
    )
    p.add_argument(
        "--http-header-timeout", type=float, default=http.header_s, metavar="S",
        help=f"close an HTTP connection whose request headers are not complete this long after their first byte "
        f"(default: {http.header_s:g})",
    )
    p.add_argument(
        "--http-body-timeout", type=float, default=http.body_s, metavar="S",
        help=f"answer 408 and close when a request body is not complete this long after its headers "
        f"(default: {http.body_s:g})",
    )
    p.add_argument(
        "--allow-unknown-fields", action="store_true",
        help="ignore request fields the OpenAI API and this server do not define (such as other servers' "
        "extensions) instead of refusing them with 400, and gRPC fields the messages do not define instead of "
        "refusing them with INVALID_ARGUMENT; fields known and not served are still refused",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='serve tool_choice "auto" (the default when a chat request has tools): the model decides whether to '
        "call a tool, and its answer is read for calls with --tool-call-parser; without it such requests are "
        'refused with 400 (tool_choice "none", "required" and a named function work either way)',
    )
    p.add_argument(
        "--tool-call-parser", choices=PARSERS, default=None,
        help="how tool calls are read from the model's answer under --enable-auto-tool-choice: hermes "
        "(<tool_call>{...}</tool_call>: Qwen2.5, Hermes) or llama3_json (a JSON call: Llama 3.1 to 3.3)",
    )
    p.add_argument(
        "--allow-special-tokens-in-prompt", action="store_true",
        help="let a special token's text typed in a prompt or chat message (such as <|im_start|>) become that "
        "special token; by default it is tokenized as plain text, so a user cannot open a turn of another role",
    )
    p.add_argument(
        "--reuse-port", action="store_true",
        help="bind the gRPC and HTTP ports with SO_REUSEPORT, beside other routers of this user on this host (the "
        "kernel spreads new connections over them)",
    )


def add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key", default=None, metavar="KEY", help="with --address: the server's API key (default: PDSERVE_API_KEY)"
    )
    p.add_argument("--tls", action="store_true", help="with --address: connect over TLS, trusting the system's CAs")
    p.add_argument("--ssl-ca-certs", default=None, metavar="PEM", help="with --address: TLS, trusting these CAs")
    p.add_argument(
        "--ssl-certfile", default=None, metavar="PEM", help="with --address: this client certificate (mutual TLS)"
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the private key of --ssl-certfile")
    p.add_argument(
        "--server-name", default=None, metavar="NAME",
        help="with --address over TLS: the name the server's certificate must carry (default: the address's host)",
    )


def add_controller_args(p: argparse.ArgumentParser) -> None:
    # The same names and defaults as `pdserve simulate`'s (pdserve.control.sim_commands).
    from pdserve.control.controller_config import ControllerConfig
    from pdserve.control.perf_model import DEFAULT_MODEL, builtin_models
    from pdserve.control.signals import Slo

    slo, interval = Slo(), ControllerConfig.__dataclass_fields__["min_interval_s"].default
    p.add_argument(
        "--controller", action="store_true",
        help="the P:D controller moves workers between the prefill and decode pools as the traffic changes, within "
        "the workers started (docs/controller.md); Admin.GetController shows its decisions",
    )
    p.add_argument(
        "--slo-ttft-ms", type=float, default=slo.ttft_ms, help=f"with --controller: TTFT SLO (default: {slo.ttft_ms:g})"
    )
    p.add_argument(
        "--slo-itl-ms", type=float, default=slo.itl_ms,
        help=f"with --controller: SLO on a request's mean inter-token latency (default: {slo.itl_ms:g})",
    )
    p.add_argument(
        "--perf-model", default=None, metavar="NAME|FILE",
        help=f"with --controller: the per-worker performance model it starts from and fits online: one of "
        f"{', '.join(builtin_models())} or a JSON file written by `bench/engine.py --perf-model` (default: "
        f"smollm2-135m-cpu on CPU, {DEFAULT_MODEL} on CUDA)",
    )
    p.add_argument(
        "--max-workers", type=int, default=None, metavar="N",
        help="with --controller: it may also add worker actors where Ray has free resources (a GPU each on CUDA), "
        "up to N workers in all, when no flip between the pools is enough, and remove them again when the load "
        "falls, never below the workers started (default: the workers started, none added)",
    )
    p.add_argument(
        "--controller-interval-s", type=float, default=interval, metavar="S",
        help="with --controller: the shortest decision interval; above it the interval follows the measured flip "
        f"time (default: {interval:g})",
    )
    p.add_argument(
        "--controller-colocated", action="store_true",
        help="with --controller: no prefill worker is a split it may choose, so it flips the last prefill worker "
        "to decode (every decode worker then prefills its own prompts: colocated) where the load favours that, and "
        "back where a split does (default: at least one prefill worker)",
    )
