"""Runs that survive a pod's life: SIGTERM finishes the step, saves and exits 143 (one process, and two under
launch/local.sh), the resumed run gives the uninterrupted run's metrics; a full disk stops the run with one line and
keeps the previous checkpoint; a log redirected to a file has no terminal control sequences.

Every run here is configs/tiny.py for 6 steps on 4 simulated CPU devices (1 process x 4, or 2 x 2), so one
uninterrupted reference run serves all the comparisons.
"""

import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_main import _assert_same_metrics, _train_rows
from test_multihost import _assert_close

REPO = pathlib.Path(__file__).resolve().parent.parent
LOCAL_SH = REPO / "launch" / "local.sh"
STEPS = 6
COMMON = (f"--config.train.num_steps={STEPS}", "--config.eval.at_start=False", "--config.metrics.tensorboard=False")


def _env(devices: int = 4) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _main_cmd(workdir, *overrides) -> list[str]:
    return [sys.executable, "-m", "tlt_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}", *COMMON,
            *overrides]


def _start(workdir, log_path, *overrides) -> subprocess.Popen:
    """The main job, 1 process x 4 devices, stdout + stderr redirected to ``log_path`` (as under a scheduler)."""
    log = open(log_path, "w")
    proc = subprocess.Popen(_main_cmd(workdir, *overrides), cwd=REPO, env=_env(), stdout=log, stderr=log)
    log.close()
    return proc


def _run(workdir, log_path, *overrides, timeout=300) -> tuple[int, str]:
    proc = _start(workdir, log_path, *overrides)
    rc = proc.wait(timeout=timeout)
    return rc, pathlib.Path(log_path).read_text()


def _steps_written(workdir) -> int:
    """The last train step in metrics.jsonl (0 if none), tolerating a line being written."""
    last = 0
    try:
        text = (pathlib.Path(workdir) / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "train":
            last = max(last, int(row["step"]))
    return last


def _wait_for_step(workdir, step: int, procs, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while _steps_written(workdir) < step:
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout} s"
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.005)


def _checkpoint_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())


def _final(workdir) -> dict:
    from tlt_jax.metrics import read_metrics

    (row,) = [r for r in read_metrics(str(workdir)) if r["kind"] == "final"]
    return row


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 1 process x 4 devices, 6 steps, a checkpoint every 2 steps (cadence does not change
    the metrics)."""
    workdir = tmp_path_factory.mktemp("reference")
    rc, out = _run(workdir, workdir / "log.txt", "--config.checkpoint.every_steps=2")
    assert rc == 0, out[-3000:]
    return workdir


# ----- the signal handler itself ----------------------------------------------------------------------------------

# Installs StopSignal, then blocks the main thread in C (waitpid restarted by the kernel after each signal, so
# Python's own handler never gets to run): only the wake-up fd thread can act on the signals.
BLOCKED = r"""
import ctypes, os, signal, subprocess, sys
from tlt_jax.distributed.preemption import StopSignal
stop = StopSignal().install()
signal.siginterrupt(signal.SIGTERM, False)
null = subprocess.DEVNULL
child = subprocess.Popen(["sleep", "120"], stdin=null, stdout=null, stderr=null)
print("ready", child.pid, flush=True)
ctypes.CDLL(None).waitpid(child.pid, None, 0)
print("main thread returned", flush=True)
"""


def test_second_signal_exits_at_once_while_the_main_thread_is_blocked():
    """The first SIGTERM is acknowledged and only recorded, and so is a repeat right after it (a scheduler's
    duplicate); a second one 2 s later exits 143 at once, though the main thread sits in a C call that never returns
    to Python."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED], cwd=REPO, env=_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = None
    try:
        ready, child = proc.stdout.readline().split()
        assert ready == "ready"
        os.kill(proc.pid, signal.SIGTERM)
        line = proc.stderr.readline()
        assert "got SIGTERM: finishing the step in flight" in line, line
        t_first = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        line = proc.stderr.readline()
        assert "got SIGTERM again within 2 s: the same stop request" in line, line
        time.sleep(max(0.0, t_first + 2.2 - time.monotonic()))
        assert proc.poll() is None  # neither the first signal nor its duplicate ends the process
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            os.kill(int(child), signal.SIGKILL)
    rest = proc.stderr.read()
    assert rc == 143 and elapsed < 5, (rc, elapsed, rest)
    assert "second SIGTERM: exiting now without saving" in rest, rest
    assert "main thread returned" not in proc.stdout.read()


def test_progress_in_a_log_file_is_plain_and_periodic(capsys):
    """Not a terminal: no bars, no control sequences; a rollout or update phase prints a plain line at most every
    interval_s seconds."""
    from tlt_jax.metrics import Progress

    now = [0.0]
    progress = Progress(10, 4, enabled=True, file=io.StringIO(), interval_s=30, clock=lambda: now[0])
    assert not progress.bars
    progress.start_rollout(32)
    for t, finished, active in ((10, 8, 24), (31, 24, 8), (50, 28, 4), (62, 32, 0)):
        now[0] = t
        progress.rollout_update(finished, active)
    progress.start_train(8)
    now[0] = 100.0
    progress.train_update(0.5)
    progress.write(" step  reward")
    progress.end_step()
    progress.start_rollout(32)
    now[0] = 101.0
    progress.rollout_update(1, 31)  # a new phase: its own 30 s
    progress.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step 5 rollout: 24/32 samples done, 8 decoding (31 s)",
        "step 5 rollout: 32/32 samples done, 0 decoding (62 s)",
        "step 5 train: 1/8 updates, loss 0.5000 (38 s)",
        " step  reward",
    ]
    assert err == "" and "\x1b" not in out and "\r" not in out
    bars = io.StringIO()
    progress = Progress(10, 0, enabled=True, file=bars, bars=True)  # a terminal: tqdm bars, no plain lines
    progress.start_rollout(4)
    progress.rollout_update(4, 0)
    progress.close()
    assert "rollout" in bars.getvalue() and capsys.readouterr().out == ""


# ----- SIGTERM in the main job ------------------------------------------------------------------------------------


def test_sigterm_saves_the_step_exits_143_and_resumes_identically(tmp_path, reference):
    """Default settings (progress bars on) with stdout + stderr in a file: SIGTERM once step 3 is done; the run
    finishes the step in flight, saves it, says where, exits 143; the log has one row per step and no control
    sequences; the resumed run's steps and final evaluation equal the uninterrupted run's."""
    for _attempt in range(3):
        work = tmp_path / f"stopped{_attempt}"
        log = tmp_path / f"stopped{_attempt}.log"
        proc = _start(work, log, "--config.checkpoint.every_steps=100")
        _wait_for_step(work, 3, [proc])
        t0 = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        elapsed = time.monotonic() - t0
        out = log.read_text()
        if rc != 0:  # else it finished all its steps before the signal: nothing to test, try again
            break
    assert rc == 143 and elapsed < 60, (rc, elapsed, out[-3000:])
    (stopped,) = _checkpoint_steps(work)  # checkpoint.every_steps=100: only the stop's
    assert 3 <= stopped <= STEPS
    assert _steps_written(work) == stopped
    last = out.strip().splitlines()[-1]
    assert last == (f"stopped by SIGTERM after step {stopped}: checkpoint in {work / 'checkpoints'}; resume with the "
                    "same --workdir"), out[-2000:]
    assert "tlt_jax: got SIGTERM: finishing the step in flight" in out
    assert "\x1b" not in out and "\r" not in out, out[:2000]
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d+\s+\d\.\d{3}\s", line)]
    assert [int(r.split()[0]) for r in rows] == list(range(1, stopped + 1)), out

    rc, out2 = _run(work, tmp_path / "resumed.log", "--config.checkpoint.every_steps=100")
    assert rc == 0, out2[-3000:]
    assert f"resumed from step {stopped}" in out2 and f"steps {stopped + 1}..{STEPS}" in out2, out2[-3000:]
    assert "\x1b" not in out2
    ref, resumed = _train_rows(reference), _train_rows(work)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in ref:
        _assert_same_metrics(ref[step], resumed[step], step)
    assert _final(work)["eval/accuracy"] == _final(reference)["eval/accuracy"]
    print(f"SIGTERM after step {stopped}: exit 143 in {elapsed:.1f} s")


@pytest.mark.multiprocess
def test_sigterm_to_local_sh_stops_both_processes_at_one_step_and_resumes_on_one(tmp_path, reference):
    """launch/local.sh -n 2 -d 2: SIGTERM to the launcher reaches both processes; they agree on one step, both take
    part in its checkpoint and exit 143, and so does the launcher; the checkpoint resumes on 1 process x 4 devices
    with the uninterrupted run's metrics."""
    work = tmp_path / "multi"
    cmd = [str(LOCAL_SH), "-n", "2", "-d", "2", "-g", "120", "--"]
    cmd += _main_cmd(work, "--config.checkpoint.every_steps=100")
    log_path = tmp_path / "multi.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=log, start_new_session=True)
    try:
        _wait_for_step(work, 3, [proc], timeout=400)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text()
    assert rc == 143 and elapsed < 60, (rc, elapsed, out[-3000:])
    (stopped,) = _checkpoint_steps(work)
    assert 3 <= stopped <= STEPS, out[-3000:]
    for p in (0, 1):
        assert f"[p{p}] stopped by SIGTERM after step {stopped}: checkpoint in {work / 'checkpoints'}" in out, out
        assert re.search(rf"local.sh: process {p} \(pid \d+\) exited with status 143", out), out[-3000:]
    data = sorted(x.name for x in (work / "checkpoints" / str(stopped) / "data").glob("process_*.json"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]  # both processes saved that step
    assert _steps_written(work) == stopped

    rc, out2 = _run(work, tmp_path / "resumed.log", "--config.checkpoint.every_steps=100")
    assert rc == 0 and f"resumed from step {stopped}" in out2, out2[-3000:]
    ref, resumed = _train_rows(reference), _train_rows(work)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in ref:
        _assert_close(resumed[step], ref[step], step)  # steps 1..stopped ran on 2 processes: rounding only
    print(f"2 processes: stopped after step {stopped}, launcher exit 143 in {elapsed:.1f} s")


# ----- a full disk ------------------------------------------------------------------------------------------------


def _mount_tmpfs(path: pathlib.Path, kib: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")


def _tree_kib(path: pathlib.Path) -> int:
    return sum(-(-f.stat().st_size // 4096) * 4 for f in path.rglob("*") if f.is_file())


def test_disk_full_stops_with_one_line_and_the_previous_checkpoint_resumes(tmp_path, reference):
    """checkpoints/ on a tmpfs that holds one checkpoint and a half: step 2's fits, step 4's fails with ENOSPC. The
    run stops (exit 4) with one line naming the directory and the error, no traceback; step 2 is intact and nothing
    half-written is a step. Made read-only, the directory stops the next run at once, also with one line. With space
    freed the run resumes from step 2 and gives the uninterrupted metrics."""
    work = tmp_path / "full"
    ckpt_dir = work / "checkpoints"
    one = _tree_kib(reference / "checkpoints" / str(STEPS))  # ~1 MiB on configs/tiny.py
    _mount_tmpfs(ckpt_dir, one * 3 // 2)
    try:
        rc, out = _run(work, tmp_path / "full.log", "--config.checkpoint.every_steps=2")
        assert rc == 4, out[-3000:]
        last = out.strip().splitlines()[-1]
        assert last == (
            f"error: cannot write checkpoint step 4 to {ckpt_dir}: No space left on device (errno 28); the previous "
            "checkpoint (step 2) is intact and resumes. Nothing half-written is ever restored. Free space (or fix "
            "the directory) and resume with the same --workdir."
        ), out[-3000:]
        assert "Traceback" not in out and "\x1b" not in out, out[-3000:]
        assert _checkpoint_steps(work) == [2]
        written = _steps_written(work)
        assert 4 <= written <= STEPS  # found within a step or two of the failed save
        assert any(p.name.startswith("4.") for p in ckpt_dir.iterdir())  # orbax's temporary directory: not a step

        # Read-only (a mount gone bad, lost permissions): found when the run opens the directory, before any step.
        subprocess.run(["mount", "-o", "remount,ro", str(ckpt_dir)], check=True)
        rc, out_ro = _run(work, tmp_path / "ro.log", "--config.checkpoint.every_steps=2")
        assert rc == 4, out_ro[-3000:]
        assert out_ro.strip().splitlines()[-1].startswith(
            f"error: cannot write to the checkpoint directory {ckpt_dir}: Read-only file system (errno 30)."
        ), out_ro[-3000:]
        assert _steps_written(work) == written and _checkpoint_steps(work) == [2]

        subprocess.run(["mount", "-o", "remount,rw,size=65536k", str(ckpt_dir)], check=True)  # space freed
        rc, out2 = _run(work, tmp_path / "resumed.log", "--config.checkpoint.every_steps=2")
        assert rc == 0 and "resumed from step 2" in out2, out2[-3000:]
        assert not any(p.name.startswith("4.") for p in ckpt_dir.iterdir())  # the leftover was cleaned up
    finally:
        subprocess.run(["umount", "-l", str(ckpt_dir)], capture_output=True)
    ref, resumed = _train_rows(reference), _train_rows(work)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in ref:
        _assert_same_metrics(ref[step], resumed[step], step)
    shutil.rmtree(work, ignore_errors=True)


# ----- launch/slurm/train.sbatch under a stand-in SLURM -----------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done  # srun's options; the task is the rest (one task: srun becomes it)
exec "$@"
"""
FAKE_TASK = """#!/bin/bash
[[ "$1 $2" == "-m tlt_jax.config_value" ]] && exec "$REAL_PYTHON" "$@"  # the script reads its config: real python
trap 'echo "task got TERM"; exit 143' TERM
echo "task $$ $*"
[[ -n "${FAKE_EXIT:-}" ]] && exit "$FAKE_EXIT"
for _ in $(seq 600); do sleep 0.1; done
exit 1
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SCONTROL_LOG"
"""
FAKE_SQUEUE = """#!/bin/bash
[[ -n "${FAKE_TIME_LEFT:-}" ]] || exit 1  # (no time limit known)
echo "$FAKE_TIME_LEFT"
"""


def _sbatch(tmp_path, *args, **env_extra) -> tuple[subprocess.Popen, int, str]:
    """launch/slurm/train.sbatch run by bash with stand-ins for srun (runs the one task), the task (waits for
    SIGTERM, then exits 143 like the main job) and scontrol (records its arguments); returns the script's process,
    the task's pid and the task's command line; ``proc.head`` holds the script's lines before the task's. squeue
    answers FAKE_TIME_LEFT (as its %L), or fails without it. ``args`` go to the script after a step count."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("task", FAKE_TASK), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", MODEL="/m", DATA="/d",
               SLURM_JOB_ID="4242", PYTHON=str(bin_dir / "task"), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               REAL_PYTHON=sys.executable, CONFIG=str(REPO / "configs" / "qwen2p5_7b_gsm8k.py"), **env_extra)
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "slurm" / "train.sbatch"), "--config.train.num_steps=3",
                             *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.head = ""
    for line in proc.stdout:
        if line.startswith("task "):
            _, pid, args = line.split(" ", 2)
            return proc, int(pid), args
        proc.head += line
    raise AssertionError(f"the task never started (status {proc.wait()})")


def test_sbatch_requeues_after_the_time_limit_signal_only(tmp_path):
    """#SBATCH asks for a signal ahead of the time limit and for requeueing. That signal (USR1 to the batch shell)
    becomes SIGTERM to srun's task; its exit 143 then requeues the job, which keeps its id and so its workdir. A
    preemption / scancel (SIGTERM to the shell and the tasks) and a finished run are not requeued by the script."""
    text = (REPO / "launch" / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    proc, task, args = _sbatch(tmp_path / "limit")
    assert "--workdir=runs/qwen2p5_7b_gsm8k-4242" in args and "--config.train.num_steps=3" in args, args
    proc.send_signal(signal.SIGUSR1)
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 143, out
    assert "task got TERM" in out and "requeueing job 4242" in out, out
    assert (tmp_path / "limit" / "scontrol.log").read_text() == "scontrol requeue 4242\n"

    proc, task, _ = _sbatch(tmp_path / "cancel")
    proc.send_signal(signal.SIGTERM)  # scancel / preemption: SLURM signals the shell and the tasks
    os.kill(task, signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 143 and "task got TERM" in out, out
    assert not (tmp_path / "cancel" / "scontrol.log").exists(), out

    proc, _, _ = _sbatch(tmp_path / "done", FAKE_EXIT="0")
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0 and not (tmp_path / "done" / "scontrol.log").exists(), out


def test_sbatch_stops_the_tasks_the_configs_stop_lead_before_the_time_limit(tmp_path):
    """checkpoint.stop_lead_s, read from the run's config and overrides: with 3 s left by squeue and a lead of 1 s
    the script stops the task itself about 2 s in (SIGTERM, exit 143, requeue) with no signal from SLURM; the
    recipe's own lead (1800 s) is what it uses without an override; squeue's day-hour form is read; a lead the
    config refuses stops the script before srun starts."""
    t0 = time.monotonic()
    proc, _, args = _sbatch(tmp_path / "lead", "--config.checkpoint.stop_lead_s=1", FAKE_TIME_LEFT="0:03")
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 143 and 1.5 <= time.monotonic() - t0 < 30, out
    assert "3 s left; the tasks are asked to stop and save 1 s before the limit" in proc.head, proc.head
    assert "--config.checkpoint.stop_lead_s=1" in args  # the tasks get the same command line
    assert "task got TERM" in out and "requeueing job 4242" in out, out
    proc, task, _ = _sbatch(tmp_path / "days", FAKE_TIME_LEFT="1-02:03:09")
    os.kill(task, signal.SIGTERM)
    proc.stdout.read()
    assert proc.wait(timeout=30) == 143 and f"{86400 + 2 * 3600 + 3 * 60 + 9} s left" in proc.head, proc.head
    assert "stop and save 1800 s before the limit" in proc.head, proc.head
    env = dict(os.environ, MODEL="/m", DATA="/d", SLURM_JOB_ID="1", PYTHON=sys.executable,
               CONFIG=str(REPO / "configs" / "qwen2p5_7b_gsm8k.py"))
    p = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "train.sbatch"), "--config.checkpoint.stop_lead_s=-5"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot read checkpoint.stop_lead_s" in p.stdout, p.stdout
    assert "config.checkpoint.stop_lead_s: must be >= 0 seconds, got -5" in p.stderr, p.stderr


def test_a_stop_cut_short_mid_step_keeps_the_last_checkpoint_and_resumes(tmp_path, reference):
    """A lead time shorter than a step: SIGTERM while step 4 runs, then the scheduler's SIGKILL before it ends (and
    before its save). Step 2's checkpoint is intact and the run resumes from it with the uninterrupted metrics."""
    for _attempt in range(4):
        work = tmp_path / f"cut{_attempt}"
        proc = _start(work, tmp_path / f"cut{_attempt}.log", "--config.checkpoint.every_steps=2")
        _wait_for_step(work, 3, [proc])
        if proc.poll() is None:
            time.sleep(0.1)  # past step 3's stop check (ms after its row): the stop request lands in step 4
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            proc.kill()
        rc = proc.wait(timeout=60)
        if rc == -signal.SIGKILL and _checkpoint_steps(work)[-1:] == [2]:
            break  # else the stop landed in step 3's check (it saved 3) or step 4 outran the kill: try again
    assert rc == -signal.SIGKILL and _checkpoint_steps(work)[-1:] == [2], (rc, _checkpoint_steps(work))
    rc, out = _run(work, tmp_path / "resumed.log", "--config.checkpoint.every_steps=2")
    assert rc == 0 and "resumed from step 2" in out, out[-3000:]
    ref, resumed = _train_rows(reference), _train_rows(work)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in ref:
        _assert_same_metrics(ref[step], resumed[step], step)
