#!/usr/bin/env bash
# Start NPROC processes of one jax.distributed job on this machine, each with DEVICES_PER_PROC simulated CPU devices.
#
#   launch/local.sh -n NPROC -d DEVICES_PER_PROC [-p PORT] -- CMD [ARGS ...]
#   e.g. launch/local.sh -n 2 -d 4 -- python -m tlt_jax.main --config=configs/tiny.py --workdir=runs/tiny2x4
#
# Each process gets TLT_JAX_COORDINATOR (localhost and a free port), TLT_JAX_NUM_PROCESSES, TLT_JAX_PROCESS_ID,
# JAX_PLATFORMS=cpu and XLA_FLAGS with --xla_force_host_platform_device_count; its output lines are prefixed
# "[pI] ". When any process fails, the others are stopped (TERM, then KILL after a grace period) and the script exits
# with the failed process's status; Ctrl-C stops all of them. Exit 0 only when every process exits 0.
set -u

usage() {
  echo "usage: $0 -n NPROC -d DEVICES_PER_PROC [-p PORT] [-g GRACE_S] -- CMD [ARGS ...]" >&2
  exit 2
}

nproc="" ndev="" port="" grace=5
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) nproc="${2:-}"; shift 2 || usage ;;
    -d) ndev="${2:-}"; shift 2 || usage ;;
    -p) port="${2:-}"; shift 2 || usage ;;
    -g) grace="${2:-}"; shift 2 || usage ;;
    --) shift; break ;;
    *) echo "$0: unknown option '$1' (put the command after --)" >&2; usage ;;
  esac
done
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "$0: -n NPROC must be a positive integer, got '$nproc'" >&2; usage; }
[[ "$ndev" =~ ^[1-9][0-9]*$ ]] || { echo "$0: -d DEVICES_PER_PROC must be a positive integer, got '$ndev'" >&2; usage; }
[[ $# -gt 0 ]] || { echo "$0: no command given after --" >&2; usage; }
if [[ -z "$port" ]]; then
  py="${PYTHON:-$(command -v python3 || command -v python)}"
  port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
    || { echo "$0: could not find a free port (give one with -p PORT)" >&2; exit 2; }
fi

xla_flags="$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')"
pids=()
stop_all() {
  local sig="$1" pid
  for pid in "${pids[@]}"; do kill "-$sig" -- "-$pid" 2>/dev/null; done
}
shutdown() {  # stop every process group, escalating to KILL after the grace period
  stop_all TERM
  local deadline=$((SECONDS + grace)) pid alive
  while ((SECONDS < deadline)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  stop_all KILL
  wait 2>/dev/null
}
trap 'echo "local.sh: interrupted; stopping all processes" >&2; shutdown; exit 130' INT TERM

for ((i = 0; i < nproc; i++)); do
  # setsid: each process leads its own group, so stopping it also stops what it started (reward workers...).
  TLT_JAX_COORDINATOR="localhost:$port" TLT_JAX_NUM_PROCESSES="$nproc" TLT_JAX_PROCESS_ID="$i" \
    JAX_PLATFORMS=cpu XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$ndev" \
    setsid "$@" > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
done

remaining=$nproc
declare -A done_pid=()
while ((remaining > 0)); do
  for i in "${!pids[@]}"; do
    pid="${pids[$i]}"
    [[ -n "${done_pid[$pid]:-}" ]] && continue
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"
    rc=$?
    done_pid[$pid]=1
    remaining=$((remaining - 1))
    if ((rc != 0)); then
      echo "local.sh: process $i (pid $pid) exited with status $rc; stopping the others" >&2
      shutdown
      exit "$rc"
    fi
  done
  sleep 0.2
done
wait 2>/dev/null
exit 0
