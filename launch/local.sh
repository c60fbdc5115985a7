#!/usr/bin/env bash
# Start NPROC processes of one jax.distributed job on this machine, each with DEVICES_PER_PROC simulated CPU devices.
#
#   launch/local.sh -n NPROC -d DEVICES_PER_PROC [-p PORT] [-g GRACE_S] -- CMD [ARGS ...]
#   e.g. launch/local.sh -n 2 -d 4 -- python -m tlt_jax.main --config=configs/tiny.py --workdir=runs/tiny2x4
#
# Each process gets TLT_JAX_COORDINATOR (localhost and a free port), TLT_JAX_NUM_PROCESSES, TLT_JAX_PROCESS_ID,
# JAX_PLATFORMS=cpu and XLA_FLAGS with --xla_force_host_platform_device_count; its output lines are prefixed
# "[pI] ". Exit 0 only when every process exits 0.
#
# Stopping (a scheduler's SIGTERM, Ctrl-C): SIGTERM / SIGINT to this script is forwarded to every process, which
# finishes its step, saves the same checkpoint step as the others and exits 128 + the signal (143 / 130); the script
# waits up to GRACE_S seconds (-g, default 300) for them, then KILLs what is left, and exits with their status. A
# second signal is forwarded too (2 s or more after the first, the processes then exit at once without saving). A
# process that exits 143 / 130 on its own (it was signalled directly) is a stop as well: the others agree on the
# same step, and get the same grace.
# A process that fails (any other non-zero status) gets the others stopped (TERM, then KILL after 5 s) and the
# script exits with the failed process's status.
set -u

usage() {
  echo "usage: $0 -n NPROC -d DEVICES_PER_PROC [-p PORT] [-g GRACE_S] -- CMD [ARGS ...]" >&2
  exit 2
}

nproc="" ndev="" port="" grace=300
fail_grace=5  # after a failure: the others are usually stuck in a collective with the dead process
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
[[ "$grace" =~ ^[0-9]+$ ]] || { echo "$0: -g GRACE_S must be a number of seconds, got '$grace'" >&2; usage; }
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
shutdown() {  # stop every process group, escalating to KILL after the failure grace period
  stop_all TERM
  local deadline=$((SECONDS + fail_grace)) pid alive
  while ((SECONDS < deadline)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  stop_all KILL
  wait 2>/dev/null
}

stop_sig=""       # TERM or INT once a stop was asked for (forwarded, or a process exited 143 / 130)
stop_deadline=0
forward() {  # the launcher got SIGTERM / SIGINT: pass it to every process (not their groups: reward workers and
  local sig="$1" pid  # the like must live until the step is done)
  if [[ -z "$stop_sig" ]]; then
    stop_sig="$sig"
    stop_deadline=$((SECONDS + grace))
    echo "local.sh: got SIG$sig; forwarding it to the $nproc processes" \
      "(they save one checkpoint and exit; KILL after ${grace} s)" >&2
  else
    echo "local.sh: got SIG$sig again; forwarding it (2 s or more after the first, the processes exit at once)" >&2
  fi
  for pid in "${pids[@]}"; do kill "-$sig" "$pid" 2>/dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

for ((i = 0; i < nproc; i++)); do
  # setsid: each process leads its own group, so stopping it also stops what it started (reward workers...).
  TLT_JAX_COORDINATOR="localhost:$port" TLT_JAX_NUM_PROCESSES="$nproc" TLT_JAX_PROCESS_ID="$i" \
    JAX_PLATFORMS=cpu XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$ndev" \
    setsid "$@" > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
done

remaining=$nproc
status=0  # the script's exit status: the first failure's, else the stop's (128 + signal), else 0
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
    if ((rc == 143 || rc == 130)); then  # stopped by a signal: the others stop after the same step
      echo "local.sh: process $i (pid $pid) exited with status $rc" >&2
      if [[ -z "$stop_sig" ]]; then
        stop_sig=$([[ $rc == 143 ]] && echo TERM || echo INT)
        stop_deadline=$((SECONDS + grace))
      fi
      ((status == 0)) && status=$rc
    elif [[ -n "$stop_sig" ]]; then
      echo "local.sh: process $i (pid $pid) exited with status $rc" >&2
      ((rc != 0 && (status == 0 || status == 143 || status == 130))) && status=$rc
    elif ((rc != 0)); then
      echo "local.sh: process $i (pid $pid) exited with status $rc; stopping the others" >&2
      shutdown
      exit "$rc"
    fi
  done
  if [[ -n "$stop_sig" ]] && ((remaining > 0 && SECONDS >= stop_deadline)); then
    echo "local.sh: $remaining processes still running ${grace} s after SIG$stop_sig; killing them" >&2
    stop_all KILL
    wait 2>/dev/null
    exit 137
  fi
  sleep 0.2
done
wait 2>/dev/null
exit "$status"
