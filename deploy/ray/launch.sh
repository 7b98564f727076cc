#!/usr/bin/env bash
# pdserve on bare metal: start the Ray cluster, one machine at a time, and serve on it.
# docs/bare-metal.md ("Several machines: the launch script") walks through two machines.
#
#   launch.sh head   [--port 6379] [--node-ip-address IP] [--pool prefill|decode|any] [--gpus N] [-- ARGS]
#   launch.sh worker --address HEAD:PORT [--node-ip-address IP] [--pool prefill|decode|any] [--gpus N] [-- ARGS]
#   launch.sh serve  --address HEAD:PORT [--prefill-tp N] [--decode-tp M] [pdserve serve flags: --prefill N ...]
#   launch.sh router --address HEAD:PORT [pdserve router flags: --host H --port P ...]
#   launch.sh status [--address HEAD:PORT]
#   launch.sh down
#   (ARGS after `--` go to `ray start`: --num-cpus, --temp-dir, port settings, ...)
#   launch.sh COMMAND --help: that command's usage
#
# A node joins a pool by offering Ray the custom resource pdserve_prefill or pdserve_decode (both
# for --pool any), as the Helm chart's worker groups do; `pdserve serve` then places each pool's
# workers on its nodes. Ray's token authentication is on: `head` writes the token to
# $PDSERVE_RAY_DIR/auth_token, and `worker`, `serve`, `router` and `status` read it from the same
# path on their machine. `down` stops, by the PIDs it recorded, what this script started on this
# machine. `serve --prefill-tp N --decode-tp M` are each pool's worker width (pdserve's
# --prefill/--decode-tensor-parallel-size; -tp N sets both): on CUDA a worker of width N takes N
# GPUs of one node, which `serve` checks against the nodes' GPUs before it starts any worker.
#
# Environment: PDSERVE_RAY_DIR (state: token, PIDs, logs; default ~/.pdserve/ray), PDSERVE_PYTHON
# (the Python with pdserve and Ray installed; default python3), PDSERVE_START_TIMEOUT (seconds to
# wait for a Ray node to start; default 120).
set -euo pipefail

STATE_DIR=${PDSERVE_RAY_DIR:-$HOME/.pdserve/ray}
PY=${PDSERVE_PYTHON:-python3}
START_TIMEOUT=${PDSERVE_START_TIMEOUT:-120}
TOKEN_FILE=$STATE_DIR/auth_token
SELF=$(basename "$0")

die() { echo "$SELF: error: $*" >&2; exit 2; }
say() { echo "$SELF: $*"; }

# The usage lines of the header, or one command's line and what it does.
usage() {
  local only=${1:-} lines
  lines=$(sed -n '5,13s/^#  //p' "$0")
  if [ -z "$only" ]; then
    echo "$lines"
    return
  fi
  echo "usage:"
  grep -E "^ launch.sh $only( |$)" <<<"$lines" || true
  case $only in
    head) echo "Start this machine's Ray head (token in $TOKEN_FILE), offering --pool's resources; ARGS after -- go to 'ray start'." ;;
    worker) echo "Join this machine to the head's Ray cluster in --pool (copy the head's token here first); ARGS after -- go to 'ray start'." ;;
    serve) echo "Start the worker pools and the first router on the cluster ('pdserve serve --address'); --prefill-tp N / --decode-tp M: ranks per prefill / decode worker (on CUDA a GPU each, all on one node)." ;;
    router) echo "Another router in front of the running pools ('pdserve router --address --no-export-worker-metrics': the first router exports the workers' series), e.g. on a second machine." ;;
    status) echo "The cluster's nodes, their pools and where each pdserve worker runs (run it on the head)." ;;
    down) echo "Stop, by the PIDs recorded in $STATE_DIR, what this script started on this machine." ;;
  esac
}
help_exit() { usage "${1:-}"; exit 0; }

ensure_state_dir() {
  mkdir -p "$STATE_DIR"
  chmod 700 "$STATE_DIR"
}

# Ray reads RAY_AUTH_MODE and the token when it starts, in every process: set them for all of them.
use_token() {
  [ -s "$TOKEN_FILE" ] || die "no Ray token at $TOKEN_FILE: copy the head's auth_token here (mode 600)"
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
}

# This machine's address on the route to HOST (a UDP connect sends nothing): what Ray itself would
# pick, made explicit so that the node is told one interface.
route_ip() {
  "$PY" -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect((sys.argv[1], 9))
except OSError as exc:
    sys.exit(f"no route to {sys.argv[1]} ({exc.strerror or exc})")
print(s.getsockname()[0])' "$1" 2>/dev/null ||
    die "--node-ip-address: this machine has no route to $1 (no default route?); give its address on the cluster network"
}

is_loopback() { case $1 in 127.*|localhost|::1) return 0 ;; *) return 1 ;; esac; }

# Ray replaces a loopback node address by the machine's own unless multi-node clusters are off
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): so a loopback head is a one-machine cluster, and every
# process that joins it (serve, status) must say the same; any other address is a normal cluster.
ray_cluster_mode() {
  if is_loopback "$1"; then
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
  else
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
  fi
}

host_of() { echo "${1%:*}"; }

# The pool's Ray resources: one unit per GPU (at least one), as the Helm chart offers them.
pool_resources() {
  local pool=$1 gpus=$2 units
  units=$(( gpus > 0 ? gpus : 1 ))
  case $pool in
    prefill) echo "{\"pdserve_prefill\": $units}" ;;
    decode) echo "{\"pdserve_decode\": $units}" ;;
    any) echo "{\"pdserve_prefill\": $units, \"pdserve_decode\": $units}" ;;
    none) echo "{}" ;;
  esac
}

# A worker's width: a whole number of ranks (GPUs on CUDA), 1 or more.
check_width() {
  case $2 in [1-9]|[1-9][0-9]) ;; *) die "$1: '$2' is not a worker width (a whole number of ranks, 1 or more)" ;; esac
}

check_args() {
  local pool=$1 gpus=$2
  case $pool in prefill|decode|any|none) ;; *) die "--pool: '$pool' is not prefill, decode, any or none" ;; esac
  case $gpus in ''|[0-9]|[0-9][0-9]) ;; *) die "--gpus: '$gpus' is not a GPU count" ;; esac
}

# Is PID alive and running the program this script recorded it for?
pid_is() {
  local pid=$1 marker=$2
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$marker"
}

# `ray start --block` in its own session: it stays the parent of the node's processes and stops
# them all on SIGTERM, and its process group holds every one of them for `down`.
start_node() {
  local role=$1; shift
  local pidfile=$STATE_DIR/$role.pid log=$STATE_DIR/$role.log pid deadline
  if [ -f "$pidfile" ] && pid_is "$(cat "$pidfile")" ray.scripts.scripts; then
    die "a Ray $role started by this script is running (PID $(cat "$pidfile")); run '$SELF down' first"
  fi
  setsid nohup "$PY" -m ray.scripts.scripts start --block "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$pidfile"
  deadline=$(( $(date +%s) + START_TIMEOUT ))
  until grep -q "Ray runtime started" "$log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$pidfile"
      tail -n 20 "$log" >&2
      die "ray start exited; its log: $log"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -n 20 "$log" >&2
      die "the Ray $role did not start within ${START_TIMEOUT}s ('$SELF down' stops PID $pid); log: $log"
    fi
    sleep 0.1
  done
}

cmd_head() {
  local port=6379 ip="" pool=any gpus=""
  while [ $# -gt 0 ]; do
    case $1 in
      --port) port=${2:?--port needs a value}; shift 2 ;;
      --node-ip-address) ip=${2:?--node-ip-address needs a value}; shift 2 ;;
      --pool) pool=${2:?--pool needs a value}; shift 2 ;;
      --gpus) gpus=${2:?--gpus needs a value}; shift 2 ;;
      --) shift; break ;;
      -h|--help) help_exit head ;;
      *) die "head: unknown argument '$1'" ;;
    esac
  done
  check_args "$pool" "$gpus"
  [ -n "$ip" ] || ip=$(route_ip 8.8.8.8) || exit 2
  [ "$ip" != "0.0.0.0" ] || die "--node-ip-address: give this machine's address on the cluster network, not 0.0.0.0"
  ray_cluster_mode "$ip"
  ensure_state_dir
  if [ ! -s "$TOKEN_FILE" ]; then
    (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN_FILE")
  fi
  use_token
  local args=(--head --port "$port" --node-ip-address "$ip" --dashboard-host 127.0.0.1
              --resources "$(pool_resources "$pool" "${gpus:-0}")")
  [ -z "$gpus" ] || args+=(--num-gpus "$gpus")
  start_node head "${args[@]}" "$@"
  echo "$ip:$port" >"$STATE_DIR/address"
  local here
  here=$(cd "$(dirname "$0")" && pwd)/$SELF
  say "Ray head on $ip:$port (pool $pool); dashboard on 127.0.0.1 only; token in $TOKEN_FILE"
  if [ "$ip" = 127.0.0.1 ]; then
    say "on loopback: a one-machine cluster no other node can join (for more, --node-ip-address <cluster address>)"
  fi
  cat <<EOF
On each other machine (pdserve installed, this repository checked out):
  1. copy the token:   scp $(hostname):$TOKEN_FILE $TOKEN_FILE   (mode 600; the path is \$PDSERVE_RAY_DIR/auth_token)
  2. join a pool:      $here worker --address $ip:$port --pool decode [--gpus N] [--node-ip-address IP]
Then, on this machine or any that has joined, serve (foreground until Ctrl-C / SIGTERM):
  $here serve --address $ip:$port --prefill P --decode D --host $ip --port 50051
Check placement with '$here status', stop with '$here down' (on each machine).
EOF
}

cmd_worker() {
  local address="" ip="" pool=any gpus=""
  while [ $# -gt 0 ]; do
    case $1 in
      --address) address=${2:?--address needs a value}; shift 2 ;;
      --node-ip-address) ip=${2:?--node-ip-address needs a value}; shift 2 ;;
      --pool) pool=${2:?--pool needs a value}; shift 2 ;;
      --gpus) gpus=${2:?--gpus needs a value}; shift 2 ;;
      --) shift; break ;;
      -h|--help) help_exit worker ;;
      *) die "worker: unknown argument '$1'" ;;
    esac
  done
  check_args "$pool" "$gpus"
  [ -n "$address" ] || die "worker: --address HEAD:PORT is required"
  ! is_loopback "$(host_of "$address")" ||
    die "worker: a head on loopback takes no other node; start it with --node-ip-address <its cluster address>"
  [ -n "$ip" ] || ip=$(route_ip "$(host_of "$address")") || exit 2
  [ "$ip" != "0.0.0.0" ] || die "--node-ip-address: give this machine's address on the cluster network, not 0.0.0.0"
  ray_cluster_mode "$ip"
  ensure_state_dir
  use_token
  local args=(--address "$address" --node-ip-address "$ip" --resources "$(pool_resources "$pool" "${gpus:-0}")")
  [ -z "$gpus" ] || args+=(--num-gpus "$gpus")
  start_node worker "${args[@]}" "$@"
  echo "$address" >"$STATE_DIR/address"
  say "Ray worker on $ip joined $address (pool $pool)"
}

# serve and router: `pdserve serve|router --address HEAD:PORT ...` in the foreground, with the token.
run_pdserve() {
  local cmd=$1 address="" rest=(); shift
  while [ $# -gt 0 ]; do
    case $1 in
      --address) address=${2:?--address needs a value}; shift 2 ;;
      --prefill-tp|--decode-tp)
        [ "$cmd" = serve ] || die "$1: only 'serve' starts workers"
        check_width "$1" "${2:-}"
        rest+=("${1%-tp}-tensor-parallel-size" "$2"); shift 2 ;;
      -h|--help)
        usage "$cmd"
        echo "Other flags go to 'pdserve $cmd' (see 'pdserve $cmd --help'); runs in the foreground until Ctrl-C / SIGTERM."
        exit 0 ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  [ -n "$address" ] || die "$cmd: --address HEAD:PORT is required"
  ray_cluster_mode "$(host_of "$address")"
  ensure_state_dir
  use_token
  # The first router (serve) exports the workers' series; another would count each worker twice
  # (as the chart's replicas, and given first so that an explicit --export-worker-metrics wins).
  local own=()
  [ "$cmd" != router ] || own=(--no-export-worker-metrics)
  # exec keeps this PID: `down` finds the process by it.
  echo $$ >"$STATE_DIR/$cmd.pid"
  exec "$PY" -m pdserve.cli "$cmd" --address "$address" "${own[@]}" "${rest[@]}"
}

cmd_status() {
  local address=""
  while [ $# -gt 0 ]; do
    case $1 in
      --address) address=${2:?--address needs a value}; shift 2 ;;
      -h|--help) help_exit status ;;
      *) die "status: unknown argument '$1'" ;;
    esac
  done
  if [ -z "$address" ] && [ -f "$STATE_DIR/address" ]; then
    address=$(cat "$STATE_DIR/address")
  fi
  [ -n "$address" ] || die "status: --address HEAD:PORT is required (no Ray node started here)"
  ray_cluster_mode "$(host_of "$address")"
  use_token
  "$PY" -m pdserve.cluster.status --address "$address"
}

# SIGTERM, then SIGKILL after a grace period, to one recorded process and its process group.
stop_pid() {
  local name=$1 marker=$2 pidfile=$STATE_DIR/$1.pid pid i
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if pid_is "$pid" "$marker"; then
    say "stopping $name (PID $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 300); do  # a grace period of 30 s
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    ! kill -0 "$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  # The node's processes share the group `ray start` leads (its PID): stop any that outlived it.
  if [ "$name" != serve ] && [ "$name" != router ] && kill -0 -- "-$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    for i in $(seq 1 100); do  # 10 s
      kill -0 -- "-$pid" 2>/dev/null || break
      sleep 0.1
    done
    ! kill -0 -- "-$pid" 2>/dev/null || kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

cmd_down() {
  case ${1:-} in -h|--help) help_exit down ;; esac
  [ $# -eq 0 ] || die "down takes no arguments"
  stop_pid router pdserve.cli
  stop_pid serve pdserve.cli
  stop_pid worker ray.scripts.scripts
  stop_pid head ray.scripts.scripts
  rm -f "$STATE_DIR/address"
  say "down"
}

if [ $# -lt 1 ]; then
  usage >&2
  exit 2
fi
sub=$1; shift
case $sub in
  head) cmd_head "$@" ;;
  worker) cmd_worker "$@" ;;
  serve|router) run_pdserve "$sub" "$@" ;;
  status) cmd_status "$@" ;;
  down) cmd_down "$@" ;;
  -h|--help|help) help_exit ;;
  *) die "unknown command '$sub' (head, worker, serve, router, status, down)" ;;
esac
