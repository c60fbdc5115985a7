"""Multi-process runs on localhost: start-up sources, launch/local.sh's failure handling, a dead peer, and the main
job on 2 processes x 4 simulated devices against 1 process x 8 (same metrics; resumed on another process count)."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tlt_jax.distributed.runtime import LaunchSpec, first_slurm_host, resolve_launch

REPO = pathlib.Path(__file__).resolve().parent.parent
LOCAL_SH = REPO / "launch" / "local.sh"
NONDETERMINISTIC = (
    "time/", "rollout/tokens_per_s", "rollout/compile_s", "rollout/background_compile_s", "eval/seconds",
    "drafter/critical_s", "drafter/step_s",
)

# A jax.distributed program that starts like the main job, reports its pid, then runs collectives until killed.
PEER = """
import os, time
from tlt_jax.distributed.runtime import initialize, resolve_launch
initialize(resolve_launch())
import jax, numpy as np
from jax.experimental import multihost_utils
print("ready", jax.process_index(), jax.process_count(), jax.device_count(), os.getpid(), flush=True)
while True:
    multihost_utils.process_allgather(np.arange(4))
    time.sleep(0.05)
"""


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----- start-up sources (no processes) ----------------------------------------------------------------------------


def test_resolve_launch_sources_and_errors():
    assert resolve_launch(env={}) is None
    spec = resolve_launch("node7:1234", 4, 3, env={"SLURM_NTASKS": "8", "SLURM_PROCID": "1"})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == ("node7:1234", 4, 3, "flags")
    local = {"TLT_JAX_COORDINATOR": "localhost:999", "TLT_JAX_NUM_PROCESSES": "2", "TLT_JAX_PROCESS_ID": "1"}
    spec = resolve_launch(env={**local, "TLT_JAX_HEARTBEAT_TIMEOUT_S": "7"})
    assert (spec.coordinator, spec.process_id, spec.source, spec.heartbeat_timeout_s) == (
        "localhost:999",
        1,
        "launch/local.sh",
        7,
    )
    slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "gpu[07-09,12]", "SLURM_JOB_ID": "5"}
    spec = resolve_launch(env=slurm)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("gpu07:20005", 4, 2)
    assert resolve_launch(env={**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # one task: no service
    assert first_slurm_host("a1,b2") == "a1" and first_slurm_host("node001") == "node001"
    with pytest.raises(ValueError, match="all of --coordinator_address"):
        resolve_launch("h:1", 2, None, env={})
    with pytest.raises(ValueError, match="process_id 2 is not in"):
        resolve_launch("h:1", 2, 2, env={})
    with pytest.raises(ValueError, match="not host:port"):
        LaunchSpec("localhost", 2, 0, "flags")
    with pytest.raises(ValueError, match="TLT_JAX_NUM_PROCESSES must be an integer"):
        resolve_launch(env={**local, "TLT_JAX_NUM_PROCESSES": "two"})


def test_local_sh_rejects_bad_usage():
    for args in (["-n", "0", "-d", "1", "--", "true"], ["-n", "2", "-d", "1"], ["-x"]):
        p = subprocess.run([str(LOCAL_SH), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and "usage:" in p.stderr, (args, p.stderr)


def test_main_rejects_partial_launch_flags(tmp_path):
    """--num_processes without the coordinator and process id is a launch error (exit 2), before any work."""
    cmd = [sys.executable, "-m", "tlt_jax.main", f"--config={REPO / 'configs' / 'tiny.py'}", f"--workdir={tmp_path}"]
    p = subprocess.run([*cmd, "--num_processes=2"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "launch error: give all of --coordinator_address, --num_processes and --process_id" in p.stderr
    assert not (tmp_path / "config.json").exists()


# ----- failures -------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_local_sh_stops_everything_when_one_process_is_killed():
    """2 processes x 2 devices; SIGKILL one: local.sh exits non-zero within 60 s and leaves no process behind."""
    proc = subprocess.Popen(
        [str(LOCAL_SH), "-n", "2", "-d", "2", "--", sys.executable, "-c", PEER],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        pids, lines = {}, []
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "".join(lines[-30:])
            lines.append(line)
            if " ready " in f" {line}":
                prefix, _, index, count, devices, pid = line.split()
                assert prefix == f"[p{index}]" and (count, devices) == ("2", "4"), line
                pids[int(index)] = int(pid)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc != 0 and elapsed < 60, (rc, elapsed)
    assert "process 1" in rest and "stopping the others" in rest, rest[-2000:]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values()), pids


@pytest.mark.multiprocess
def test_dead_peer_ends_survivor_in_bounded_time(tmp_path):
    """Started from SLURM's variables (no launcher to stop it), a survivor exits non-zero soon after its peer dies."""
    procs = []
    for i in range(2):
        env = _env(
            SLURM_JOB_ID=str(1000 + os.getpid() % 9000),
            SLURM_NTASKS="2",
            SLURM_PROCID=str(i),
            SLURM_LOCALID=str(i),
            SLURM_STEP_NODELIST="localhost",
            TLT_JAX_HEARTBEAT_TIMEOUT_S="5",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
        )
        log = open(tmp_path / f"p{i}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, "-c", PEER], env=env, stdout=log, stderr=log), log))
    try:
        deadline = time.monotonic() + 120
        while not all("ready" in (tmp_path / f"p{i}.log").read_text() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs)
            time.sleep(0.2)
        procs[1][0].kill()
        t0 = time.monotonic()
        rc = procs[0][0].wait(timeout=45)
        elapsed = time.monotonic() - t0
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    out = (tmp_path / "p0.log").read_text()
    assert rc != 0 and elapsed < 45, (rc, elapsed)
    assert "Gloo" in out or "another task died" in out or "heartbeat" in out, out[-3000:]


# Exercises the host collectives on 2 processes (1 device each) and prints what each process got.
HELPERS = r"""
import json
from tlt_jax.distributed.runtime import initialize, resolve_launch
initialize(resolve_launch())
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tlt_jax.data import prompt_dataset
from tlt_jax.distributed import make_mesh
from tlt_jax.distributed.multihost import ProcessShardedReward, gather_global_batch, reduce_metrics, to_host
from tlt_jax.rewards import RewardOutput

me = jax.process_index()
examples = [{"prompt_ids": [i, np.int64(i)], "ground_truth": str(i)} for i in range(12)]
local = next(iter(prompt_dataset(examples, 4, seed=3, num_epochs=None)))  # this process's 2 of the step's 4
batch = gather_global_batch(local)
whole = next(iter(prompt_dataset(examples, 4, seed=3, num_epochs=None, shard_index=0, shard_count=1)))
whole = [dict(e, prompt_ids=[int(t) for t in e["prompt_ids"]]) for e in whole]
seen = []
def reward(exs, comps):
    seen.extend(int(e["ground_truth"]) for e in exs)
    s = np.array([[float(e["ground_truth"]) + j for j in range(len(c))] for e, c in zip(exs, comps)], np.float32)
    return RewardOutput(s, s > 5, {"reward/timeouts": 1.0})
out = ProcessShardedReward(reward)(batch, [[[1], [2]] for _ in batch])
x = jax.device_put(np.arange(8.0).reshape(4, 2), NamedSharding(make_mesh(), PartitionSpec("data")))
reduced = reduce_metrics({"time/step_s": 1.0 + me, "reward/mean": 0.5})
try:
    reduce_metrics({"reward/mean": float(me)})
    diverged = ""
except RuntimeError as e:
    diverged = str(e)
from tlt_jax.adaptive import agreed_all, agreed_seconds
agreed = [list(agreed_all(me == 0, True, me == 1)), agreed_seconds(0.25 + me), list(agreed_seconds(0.5 + me, 2.0 - me))]
alone = [list(agreed_all(me == 0, across=False)), agreed_seconds(0.25 + me, across=False)]  # a slice's own engine
exact = reduce_metrics({"response/len_p90": 8.6})["response/len_p90"] == 8.6  # float64 survives the gather
# Sliced rollouts across processes: the board, process-local copies of sharded weights, the replicas' average.
import time
from tlt_jax.distributed.board import Board
from tlt_jax.distributed import engine_meshes
from tlt_jax.drafter.replicas import ReplicaMerger
board = Board("test")
board.post(f"7/{me}")
deadline = time.time() + 30
while board.keys("7") != {"0", "1"} and time.time() < deadline:
    time.sleep(0.01)
posted = sorted(board.keys("7"))
import threading
stop = threading.Event()
stop.set()
waited = [board.wait(f"7/{1 - me}", threading.Event()), board.wait("8/never", stop)]  # the other's key; a stop
posted.append(waited)
# the reshard: a policy FSDP-sharded over both processes into one bfloat16 engine per process, each assembled from
# its own devices' shards of one program's output (no host copy)
import jax.numpy as jnp
from flax import nnx
from tlt_jax.distributed import MeshConfig, shard_module
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout.reshard import Resharder
policy = shard_module(CausalLM(tiny_config(), rngs=nnx.Rngs(0)), make_mesh(MeshConfig(data=1, fsdp=-1)))
copies = Resharder(engine_meshes(make_mesh(), 2), dict(dtype=jnp.bfloat16))(policy)
q = nnx.state(copies[me])["layers"]["self_attn"]["q_proj"][...]
q_ref = nnx.state(CausalLM(tiny_config(), rngs=nnx.Rngs(0)))["layers"]["self_attn"]["q_proj"][...]
local_copy = [sorted(copies), q.is_fully_addressable, str(q.dtype),
              bool(np.array_equal(np.asarray(q), np.asarray(q_ref.astype(jnp.bfloat16))))]
slices = engine_meshes(make_mesh(), 2)  # one slice per process
merger = ReplicaMerger(slices, {"p": PartitionSpec(), "count": PartitionSpec()}, 2)
put = lambda v: jax.device_put(v, NamedSharding(slices[me], PartitionSpec()))
state = {"p": put(np.full((2, 3), 0.5 + me, np.float32)), "count": put(np.array(5 * me, np.int32))}
avg, meta = merger({me: state}, {me: me == 1}, {me: 4 * me}, {me: [2.0 * me, 0.5]} if me else {})
steps, sums = merger.read(meta)
both, _ = merger({me: state}, {me: True}, {me: 1}, {})
exchanged = [np.asarray(avg[me]["p"]).tolist(), int(avg[me]["count"]), avg[me]["p"].sharding.mesh == slices[me],
             steps, sums, float(np.asarray(both[me]["p"])[0, 0])]
# a train state on a mesh over both processes (one device each): its counters list their shards, and the bound of a
# checkpoint's writes is the largest shard (4 x 2 float32 = 32 bytes per process, under the floor)
import optax
from tlt_jax.checkpoint import save_in_flight_bytes
from tlt_jax.rl.train_step import init_train_state
state = init_train_state({"w": jax.device_put(np.ones((8, 2), np.float32),
                                              NamedSharding(make_mesh(), PartitionSpec("data")))}, optax.adam(1e-3))
counters = [len(state.step.addressable_shards), int(state.step), save_in_flight_bytes(state, floor=0)]
print("RESULT " + json.dumps(dict(
    me=me, batch=batch == whole, mine=seen, scores=out.scores.tolist(), info=out.info,
    host=to_host(x * 2).tolist(), reduced=reduced, diverged=diverged, agreed=agreed, alone=alone, exact=exact,
    posted=posted, local_copy=local_copy, exchanged=exchanged, counters=counters)), flush=True)
"""


@pytest.mark.multiprocess
def test_host_collectives_on_two_processes():
    """Global batch = the unsharded pipeline's; each process scores only its prompts and all get every score;
    sharded arrays come to every host; metrics agree (time/* = slowest, float64 exact) and a divergence is an error;
    the bandit's flags and seconds agree (not for a slice's own engine); the board, the reshard into one engine per
    process and the drafter replicas' average on the devices work across processes."""

    p = subprocess.run(
        [str(LOCAL_SH), "-n", "2", "-d", "1", "--", sys.executable, "-c", HELPERS],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = {r["me"]: r for r in (json.loads(x.split("RESULT ", 1)[1]) for x in p.stdout.splitlines() if "RESULT" in x)}
    assert sorted(res) == [0, 1]
    r0, r1 = res[0], res[1]
    assert r0["batch"] and r1["batch"]
    assert len(r0["mine"]) == len(r1["mine"]) == 2 and not set(r0["mine"]) & set(r1["mine"])
    assert r0["scores"] == r1["scores"] and r0["info"] == r1["info"] == {"reward/timeouts": 2.0}
    assert sorted(s[0] for s in r0["scores"]) == sorted(r0["mine"] + r1["mine"])
    assert r0["host"] == r1["host"] == (np.arange(8.0).reshape(4, 2) * 2).tolist()
    assert r0["reduced"] == r1["reduced"] == {"time/step_s": 2.0, "reward/mean": 0.5}
    assert "processes diverged: metric 'reward/mean' is [0.0, 1.0]" in r0["diverged"]
    # the bandit's agreement: a flag holds only where it holds on every process; seconds are the slowest process's
    assert r0["agreed"] == r1["agreed"] == [[False, True, False], 1.25, [1.5, 2.0]]
    assert r0["alone"] == [[True], 0.25] and r1["alone"] == [[False], 1.25]  # across=False: no collective
    assert r0["exact"] and r1["exact"]
    # sliced rollouts across processes: each sees the other's notice, a whole local copy of a sharded array, and
    # the replicas' average on its own slice (only process 1's slice trained, then both) with each slice's step
    # count and metric sums
    assert r0["posted"] == r1["posted"] == ["0", "1", [True, False]]  # a key seen by keys() and wait()
    assert r0["local_copy"] == [[0], True, "bfloat16", True] and r1["local_copy"] == [[1], True, "bfloat16", True]
    assert r0["counters"] == r1["counters"] == [1, 0, 32 + 2**20]  # init_train_state across processes
    assert r0["exchanged"] == r1["exchanged"] == [np.full((2, 3), 1.5).tolist(), 5, True, {"1": 4},
                                                  {"1": [2.0, 0.5]}, 1.0]


# ----- the main job across processes ------------------------------------------------------------------------------


def _train_rows(workdir):
    from tlt_jax.metrics.writers import read_metrics

    return {r["step"]: r for r in read_metrics(str(workdir)) if r["kind"] == "train"}


def _assert_close(a: dict, b: dict, step: int):
    keys = {k for k in a if not k.startswith(NONDETERMINISTIC)}
    assert keys == {k for k in b if not k.startswith(NONDETERMINISTIC)}, (step, keys ^ set(b))
    for k in sorted(keys):
        if isinstance(a[k], float):
            # Cross-process all-reduces (gloo) may sum in another order than the in-process ones: rounding only.
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (step, k, a[k], b[k])
        else:
            assert a[k] == b[k], (step, k, a[k], b[k])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_match_one_and_resume_on_another_count(tmp_path):
    """configs/tiny.py, 3 steps: 2 processes x 4 devices (launch/local.sh) give 1 process x 8 devices' metrics;
    then the 2-process run's step-2 checkpoint resumes in 1 process and step 3 matches again."""
    from test_main import _cfg

    from tlt_jax.main import run

    common = (
        "--config.train.num_steps=3",
        "--config.checkpoint.every_steps=1",
        "--config.eval.at_start=False",
        # Small enough that compiling (twice per process on 2 CPU cores) stays short.
        "--config.data.prompts_per_step=4",
        "--config.rollout.samples_per_prompt=2",
        "--config.rollout.max_new_tokens=8",
        "--config.rl.micro_batch_size=8",
        "--config.data.eval_size=4",
        "--config.eval.batch_size=4",
    )
    ref_dir, multi = tmp_path / "ref", tmp_path / "multi"
    t0 = time.perf_counter()
    run(_cfg("tiny.py", *common), str(ref_dir))
    t1 = time.perf_counter()
    ref = _train_rows(ref_dir)

    cmd = [str(LOCAL_SH), "-n", "2", "-d", "4", "--", sys.executable, "-m", "tlt_jax.main"]
    cmd += [f"--config={REPO / 'configs' / 'tiny.py'}", f"--workdir={multi}", "--config.metrics.progress_bars=False"]
    p = subprocess.run([*cmd, *common], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=500)
    t2 = time.perf_counter()
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "[p0] workdir" in p.stdout and "[p1] workdir" not in p.stdout  # only process 0 prints the run
    assert "process 1 of 2 (launch/local.sh" in p.stderr and "4 local / 8 global cpu devices" in p.stderr
    rows = _train_rows(multi)
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        _assert_close(rows[step], ref[step], step)
    for step in (1, 2, 3):  # the reshard is inside the rollout's time; its bytes are the 1-process run's
        assert 0 < rows[step]["time/reshard_s"] < rows[step]["time/rollout_s"], rows[step]
        assert rows[step]["rollout/reshard_bytes"] == ref[step]["rollout/reshard_bytes"] > 0, step
    data_files = sorted(x.name for x in (multi / "checkpoints" / "3" / "data").glob("process_*.json"))
    assert data_files == ["process_0-of-2.json", "process_1-of-2.json"]  # every process took part in the save

    # Resume the 2-process checkpoint of step 2 in one process (8 devices): step 3 again, same metrics.
    shutil.rmtree(multi / "checkpoints" / "3")
    run(_cfg("tiny.py", *common), str(multi))
    resumed = _train_rows(multi)
    assert sorted(resumed) == [1, 2, 3]
    assert resumed[2] == rows[2]  # kept, not re-run: the run restarted from step 2 (wall-clock keys included)
    assert not (tmp_path / "multi" / "checkpoints_unreadable").exists()
    _assert_close(resumed[3], ref[3], 3)
    print(f"1x8: {t1 - t0:.0f} s, 2x4: {t2 - t1:.0f} s, resume 1x8: {time.perf_counter() - t2:.0f} s")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tlt_slices_across_two_processes(tmp_path):
    """configs/tiny_tlt.py with one rollout engine per tensor-parallel group (mesh.tensor 2, rollout.num_slices -1),
    2 processes x 2 devices (launch/local.sh -n 2 -d 2), so one engine per process: the RL metrics are those of
    1 process x 4 devices with the same two engines; in every step one process's engine trains the drafter while
    the other process's slice still decodes (the timeline names each slice's process); the replicas of both
    processes are averaged into one drafter; every process keeps its own drafter buffer in the checkpoint."""
    from tlt_jax.controller.controller import TIMELINE_FILE

    common = (
        "--config.train.num_steps=2",
        "--config.eval.at_start=False",
        "--config.mesh.tensor=2",
        "--config.rollout.num_slices=-1",
        "--config.data.prompts_per_step=4",
        "--config.rollout.samples_per_prompt=2",
        "--config.rl.micro_batch_size=8",
        "--config.data.eval_size=4",
        "--config.eval.batch_size=4",
        "--config.metrics.progress_bars=False",
    )
    ref_dir, multi = tmp_path / "ref", tmp_path / "multi"
    for workdir, procs, devices in ((ref_dir, "1", "4"), (multi, "2", "2")):
        cmd = [str(LOCAL_SH), "-n", procs, "-d", devices, "--", sys.executable, "-m", "tlt_jax.main"]
        cmd += [f"--config={REPO / 'configs' / 'tiny_tlt.py'}", f"--workdir={workdir}"]
        p = subprocess.run([*cmd, *common], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ref, rows = _train_rows(ref_dir), _train_rows(multi)
    # every process logs a checksum of its slice's copy of the averaged drafter: the same on both, each step
    sums = {0: [], 1: []}
    for total, process, checksum in re.findall(r"drafter average after (\d+) steps: process (\d) slice \d checksum "
                                               r"(\S+)", p.stderr):
        sums[int(process)].append((int(total), checksum))
    assert len(sums[0]) == 2 and sums[0] == sums[1], sums  # one line per RL step on each
    assert sorted(rows) == sorted(ref) == [1, 2]
    rl = ("reward/", "response/", "train/", "eval/")
    for step in (1, 2):
        _assert_close({k: v for k, v in rows[step].items() if k.startswith(rl)},
                      {k: v for k, v in ref[step].items() if k.startswith(rl)}, step)
        # scored during the rollout by the slice that finished first (either process's) after its first drafter
        # step, reported by process 0; not scored (None) when the rollout ended first
        # (after a drafter step on its thread, so a scored step trained)
        top1 = rows[step]["drafter/top1"]
        assert top1 is None or (0 <= top1 <= 1 and rows[step]["drafter/steps"] >= 1), rows[step]
        for k in ("drafter/buffer_tokens", "buffer/samples"):  # each process buffers its own slice's: summed
            assert rows[step][k] == ref[step][k] > 0, (step, k)
        # the critical path holds the drafter work in flight on either process (process 0 reports it), not only its own
        assert rows[step]["drafter/critical_s"] >= rows[step]["controller/overhang_s"] >= 0, rows[step]
        # neither process started its deferred compiles while the other's slice decoded or drafter work was in flight
        assert rows[step]["controller/compile_release_s"] >= rows[step]["controller/overhang_s"], rows[step]
    # drafter steps ran while the other process's slice decoded (a step not started when it ended is dropped)
    assert any(rows[step]["drafter/steps"] > 0 for step in (1, 2)), rows
    timeline = [json.loads(line) for line in (multi / TIMELINE_FILE).read_text().splitlines()]
    assert {(t["process"], t["slice"]) for t in timeline} == {(0, 0), (1, 1)}
    for step in (1, 2):
        spans = [t for t in timeline if t["step"] == step]
        assert any(a["state"] == "training" and b["state"] == "busy" and a["process"] != b["process"]
                   and a["start"] < b["end"] and b["start"] < a["end"] for a in spans for b in spans), spans
    for i in (0, 1):
        assert (multi / "drafter_buffer" / f"process_{i}" / "step_2.npz").exists()
    assert (multi / "drafter_eagle").is_dir()
