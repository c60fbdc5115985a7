"""The main job end to end on configs/tiny.py: learning, kill -9 + resume, NaN handling, workdir outputs, errors."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from tlt_jax.config import ConfigError, from_config_dict
from tlt_jax.main import NonFiniteError, run
from tlt_jax.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
# Wall-clock and throughput metrics differ between runs; everything else must match.
NONDETERMINISTIC = (
    "time/", "rollout/tokens_per_s", "rollout/compile_s", "rollout/background_compile_s", "eval/seconds",
    "drafter/critical_s", "drafter/step_s",
)


def _cfg(name="tiny.py", *overrides):
    argv = ["prog", f"--config={REPO / 'configs' / name}", "--config.metrics.progress_bars=False", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return from_config_dict(fv.config)


def _cli(workdir, *overrides, config="tiny.py", **kw):
    cmd = [
        sys.executable,
        "-m",
        "tlt_jax.main",
        f"--config=configs/{config}",
        f"--workdir={workdir}",
        "--config.metrics.progress_bars=False",
        *overrides,
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _train_rows(workdir):
    return {r["step"]: r for r in read_metrics(str(workdir)) if r["kind"] == "train"}


def _assert_same_metrics(a, b, step):
    keys = {k for k in a if not k.startswith(NONDETERMINISTIC)}
    assert keys == {k for k in b if not k.startswith(NONDETERMINISTIC)}, step
    for k in sorted(keys):
        if isinstance(a[k], float):
            assert abs(a[k] - b[k]) <= 1e-6, (step, k, a[k], b[k])
        else:
            assert a[k] == b[k], (step, k)


def test_tiny_task_learns(tmp_path):
    """A random tiny model learns the target-token task on CPU: mean reward rises clearly, greedy eval solves it."""
    t0 = time.perf_counter()
    final = run(_cfg("tiny.py"), str(tmp_path))
    rows = _train_rows(tmp_path)
    rewards = [rows[s]["reward/mean"] for s in sorted(rows)]
    assert len(rewards) == 20
    assert np.mean(rewards[:3]) < 0.1  # chance is 1/64 per token
    assert np.mean(rewards[-3:]) > 0.6, rewards
    evals = [r for r in read_metrics(str(tmp_path)) if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["eval/accuracy"] < 0.1  # eval.at_start
    assert final["eval/accuracy"] >= 0.5, final
    print(f"tiny run: {time.perf_counter() - t0:.1f} s, rewards {np.round(rewards, 3).tolist()}")


def test_workdir_outputs(tmp_path, capsys):
    cfg = _cfg(
        "tiny.py", "--config.train.num_steps=2", "--config.eval.at_start=False", "--config.metrics.progress_bars=True"
    )
    assert cfg.metrics.progress_bars
    run(cfg, str(tmp_path))
    out, err = capsys.readouterr()
    # pytest's captured streams are no terminal: plain lines, no bars or control sequences (tests/test_preemption.py
    # draws the bars on a stream that is one)
    assert "\x1b" not in out + err and "steps:" not in err
    header = next(line for line in out.splitlines() if line.split()[:2] == ["step", "reward"])
    for col in ("acc", "len p50", "p90", "max", "rollout s", "tail s", "reward s", "train s", "tok/s"):
        assert col in header
    assert "final evaluation accuracy:" in out and f"plots in {tmp_path / 'plots'}" in out
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0
    assert (tmp_path / "plots" / "response_lengths.png").stat().st_size > 0
    lengths = [json.loads(line) for line in (tmp_path / "lengths.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lengths] == [1, 2] and all(len(r["lengths"]) == 32 for r in lengths)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["num_steps"] == 2 and saved["model"]["source"] == "tiny"
    rows = read_metrics(str(tmp_path))
    assert [r["kind"] for r in rows] == ["train", "train", "final"]
    for key in (
        "reward/mean",
        "reward/accuracy",
        "response/len_p50",
        "response/len_p90",
        "response/len_max",
        "time/rollout_s",
        "time/tail_s",
        "time/reward_s",
        "time/train_s",
        "time/logprob_s",
        "rollout/tokens_per_s",
        "train/kl_loss",
        "train/entropy",
        "train/grad_norm",
        "train/lr",
    ):
        assert key in rows[0], key
    assert "eval/accuracy" in rows[-1]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


def test_kill9_and_resume_gives_identical_metrics(tmp_path):
    """4 steps straight vs. killed (-9) after step 2's checkpoint and resumed: steps 3-4 identical."""
    common = ("--config.train.num_steps=4", "--config.checkpoint.every_steps=2", "--config.eval.at_start=False")
    ref_dir = tmp_path / "ref"
    run(_cfg("tiny.py", *common), str(ref_dir))
    ref = _train_rows(ref_dir)

    work = tmp_path / "killed"
    for _attempt in range(3):
        proc = _cli(work, *common)
        ckpt2 = work / "checkpoints" / "2"
        while proc.poll() is None and not ckpt2.is_dir():
            time.sleep(0.002)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        out = proc.stdout.read()
        assert ckpt2.is_dir(), out
        # Retry if the process outran the kill and finished (then there is nothing left to resume).
        if not (work / "checkpoints" / "4").is_dir():
            break
        import shutil

        shutil.rmtree(work)
    assert proc.returncode == -signal.SIGKILL
    proc = _cli(work, *common)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "resumed from step 2" in out or "steps 3..4" in out, out
    resumed = _train_rows(work)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        _assert_same_metrics(ref[step], resumed[step], step)
    ref_final = [r for r in read_metrics(str(ref_dir)) if r["kind"] == "final"]
    new_final = [r for r in read_metrics(str(work)) if r["kind"] == "final"]
    assert len(new_final) == 1 and new_final[0]["eval/accuracy"] == ref_final[0]["eval/accuracy"]


def test_single_nan_step_is_skipped_and_counted(tmp_path):
    cfg = _cfg(
        "tiny.py", "--config.train.num_steps=3", "--config.train.debug_nan_steps=(2,)", "--config.eval.at_start=False"
    )
    run(cfg, str(tmp_path))
    rows = _train_rows(tmp_path)
    assert [rows[s]["train/nonfinite_step"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [rows[s]["train/skipped_total"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(np.isfinite(rows[3][k]) for k in ("train/loss", "train/grad_norm"))


def test_consecutive_nan_steps_stop_the_run_and_keep_checkpoints(tmp_path):
    cfg = _cfg(
        "tiny.py",
        "--config.train.num_steps=8",
        "--config.train.debug_nan_steps=(3, 4, 5)",
        "--config.train.max_nonfinite_steps=3",
        "--config.checkpoint.every_steps=1",
        "--config.eval.at_start=False",
    )
    with pytest.raises(NonFiniteError, match=r"stopping at step 5: 3 consecutive steps had a non-finite") as e:
        run(cfg, str(tmp_path))
    assert "the latest is step 4" in str(e.value)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 3, 4]  # max_to_keep=3; nothing written for the failing step, nothing lost
    rows = _train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4, 5] and rows[5]["train/skipped_total"] == 3.0


def test_cli_errors(tmp_path):
    p = _cli(tmp_path / "a", "--config.rl.klcoef=0.1")
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0 and "klcoef" in out
    p = _cli(tmp_path / "b", "--config.rollout.samples_per_prompt=1")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "config.rollout.samples_per_prompt: GRPO groups need >= 2 samples" in out


# gsm8k.py's shipped drafter is SmolLM2's: runs of that config on another policy decode without one.
_NO_DRAFTER = (
    "--config.rollout.speculative=off",
    "--config.rollout.spec_arms=",
    "--config.drafter.online=False",
)


def _gsm_file_cfg(train_path, *extra):
    return _cfg(
        "gsm8k.py",
        "--config.model.source=path",
        f"--config.model.path={FIXTURES / 'tiny_qwen2'}",
        "--config.data.source=gsm8k_file",
        f"--config.data.train_path={train_path}",
        "--config.data.eval_size=2",
        "--config.data.chat_template=False",
        "--config.data.max_prompt_len=512",
        "--config.rollout.max_new_tokens=8",
        "--config.rollout.samples_per_prompt=4",
        "--config.rl.micro_batch_size=8",  # a multiple of the 8 devices of the batch axes
        "--config.reward.num_workers=1",
        "--config.train.num_steps=1",
        "--config.metrics.tensorboard=False",
        *_NO_DRAFTER,
        *extra,
    )


def test_missing_data_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GSM8K file not found"):
        run(_gsm_file_cfg(tmp_path / "nope.jsonl"), str(tmp_path / "w"))


def test_gsm8k_file_with_malformed_rows_counts_them(tmp_path):
    """An HF-directory model + a GSM8K jsonl with bad rows: they are skipped and counted in the step metrics."""
    rows = [
        json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}) for i in range(8)
    ]
    rows += ["{not json", json.dumps({"question": "no answer"}), json.dumps({"question": "q", "answer": "no hashes"})]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    final = run(_gsm_file_cfg(path), str(tmp_path / "w"))
    step = _train_rows(tmp_path / "w")[1]
    assert step["data/malformed_rows"] == 3.0
    assert step["data/train_examples"] == 6.0 and step["data/eval_examples"] == 2.0  # last 2 rows held out
    assert 0.0 <= final["eval/accuracy"] <= 1.0 and final["eval/num_examples"] == 2.0


def test_config_error_is_raised_before_work(tmp_path):
    with pytest.raises(ConfigError, match="micro_batch_size"):
        _cfg("tiny.py", "--config.rl.micro_batch_size=5")


def test_micro_batch_that_does_not_divide_the_batch_axes_is_a_config_error(tmp_path):
    """8 devices on the data axis, micro-batches of 4 sequences: an error naming the key, before the model loads."""
    cfg = _cfg("tiny.py", "--config.rl.micro_batch_size=4")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"config\.rl\.micro_batch_size: 4 does not divide .* fsdp = 8 devices"):
        run(cfg, str(tmp_path))
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "checkpoints").exists()


def test_final_row_reports_peak_resident_memory(tmp_path, capsys):
    run(_cfg("tiny.py", "--config.eval.at_start=False", "--config.train.num_steps=1"), str(tmp_path))
    (final,) = [r for r in read_metrics(str(tmp_path)) if r["kind"] == "final"]
    assert 0 < final["memory/peak_rss_gib"] < 64
    assert f"peak resident memory {final['memory/peak_rss_gib']:.2f} GiB" in capsys.readouterr().out


def test_non_default_knobs_end_to_end(tmp_path):
    """bf16 compute, remat, 2 mini-batches x 2 epochs, RLOO, k1 KL, cosine warm-up, periodic eval,
    synchronous checkpoints, no TensorBoard: the run completes and each knob shows in what it records."""
    cfg = _cfg(
        "tiny.py",
        "--config.model.dtype=bfloat16",
        "--config.model.remat=True",
        "--config.rl.mini_batch_prompts=4",
        "--config.rl.epochs=2",
        "--config.rl.advantage=rloo",
        "--config.rl.kl_kind=k1",
        "--config.rl.micro_batch_size=8",
        "--config.optim.schedule=cosine",
        "--config.optim.warmup_steps=1",
        "--config.eval.every_steps=1",
        "--config.eval.max_new_tokens=4",
        "--config.eval.at_start=False",
        "--config.checkpoint.async_save=False",
        "--config.metrics.tensorboard=False",
        "--config.train.num_steps=2",
    )
    final = run(cfg, str(tmp_path))
    rows = _train_rows(tmp_path)
    assert rows[1]["train/updates"] == 4.0 and rows[2]["train/updates"] == 8.0  # 2 mini-batches x 2 epochs
    assert rows[1]["eval/len_mean"] <= 4 and "eval/accuracy" in rows[1]  # eval.every_steps, eval.max_new_tokens
    assert 0 < rows[2]["train/lr"] < rows[1]["train/lr"] < 1e-2  # warm-up, then cosine decay (step means)
    assert not (tmp_path / "tensorboard").exists()
    assert final["eval/len_mean"] <= 4


def test_gsm_symbolic_source_with_hf_model(tmp_path):
    """reasoning-gym gsm_symbolic train/eval split, tokenised with an HF-directory tokenizer."""
    cfg = _cfg(
        "gsm8k.py",
        "--config.model.source=path",
        f"--config.model.path={FIXTURES / 'tiny_qwen2'}",
        "--config.data.train_size=4",
        "--config.data.eval_size=2",
        "--config.data.chat_template=False",
        "--config.data.max_prompt_len=1024",
        "--config.rollout.max_new_tokens=4",
        "--config.rollout.samples_per_prompt=4",
        "--config.rl.micro_batch_size=8",  # a multiple of the 8 devices of the batch axes
        "--config.reward.num_workers=1",
        "--config.train.num_steps=1",
        *_NO_DRAFTER,
    )
    final = run(cfg, str(tmp_path))
    step = _train_rows(tmp_path)[1]
    assert step["data/train_examples"] == 4.0 and step["data/eval_examples"] == 2.0
    assert final["eval/num_examples"] == 2.0


@pytest.mark.slow
def test_gsm8k_default_config_one_small_step(tmp_path):
    """The main job as a user runs it (one CPU device, SmolLM2-135M GGUF, chat template, arithmetic task, adaptive
    speculation from the shipped drafter, online drafter training), shrunk to one small step."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    overrides = (
        "--config.data.train_size=8",
        "--config.data.eval_size=2",
        "--config.data.prompts_per_step=2",
        "--config.rollout.samples_per_prompt=2",
        "--config.rollout.max_new_tokens=8",
        "--config.rl.micro_batch_size=2",
        "--config.train.num_steps=1",
        "--config.eval.batch_size=2",
    )
    p = _cli(tmp_path, *overrides, config="gsm8k.py", env=env)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "1 cpu devices" in out and "134.5M params" in out and "final evaluation accuracy" in out, out
    step = _train_rows(tmp_path)[1]
    assert step["response/len_max"] <= 8 and np.isfinite(step["train/loss"]) and step["train/nonfinite_step"] == 0
    assert "train/kl_loss" not in step  # rl.kl_coef = 0: no reference pass
    assert step["drafter/steps"] >= 1 and np.isfinite(step["drafter/loss"])  # the shipped drafter trains online
    assert sum(v for k, v in step.items() if k.startswith("rollout/arm_share/")) == pytest.approx(1.0)


def _tiny_drafter(cfg, path, **overrides):
    """A random-weight EAGLE drafter of the tiny policy's shape (builders.build_model's config), saved to ``path``:
    losslessness does not depend on the drafter's quality."""
    from flax import nnx

    from tlt_jax.builders import tiny_model_config
    from tlt_jax.drafter import EagleDrafter, save_drafter

    save_drafter(EagleDrafter(tiny_model_config(cfg, **overrides), rngs=nnx.Rngs(0)), path)
    return str(path)


def test_speculative_rollouts_leave_training_unchanged(tmp_path):
    """n-gram and EAGLE tree speculative decoding in the rollout: same samples, so identical losses / rewards / KL
    (old log-probs are recomputed by the policy, never taken from the rollout); the accept length is reported, for
    the rollouts and the final evaluation."""
    common = ("--config.train.num_steps=3", "--config.eval.at_start=False", "--config.metrics.tensorboard=False")
    assert "eval/accept_length" not in run(_cfg("tiny.py", *common), str(tmp_path / "plain"))
    drafter = _tiny_drafter(_cfg("tiny.py"), tmp_path / "drafter")
    runs = {
        "ngram": ("--config.rollout.speculative=ngram", "--config.rollout.spec_threshold=32"),
        "eagle": (
            "--config.rollout.speculative=eagle",
            f"--config.rollout.drafter_path={drafter}",
            "--config.rollout.spec_depth=3",
            "--config.rollout.spec_topk=2",
            "--config.rollout.spec_verify_tokens=6",
        ),
    }
    plain = _train_rows(tmp_path / "plain")
    for mode, overrides in runs.items():
        final = run(_cfg("tiny.py", *common, *overrides), str(tmp_path / mode))
        assert final["eval/accept_length"] >= 1.0, (mode, final)  # the held-out greedy evaluation speculates too
        sd = _train_rows(tmp_path / mode)
        for step in (1, 2, 3):
            assert sd[step]["rollout/accept_length"] >= 1.0 and sd[step]["rollout/verify_steps"] > 0, (mode, step)
            a = {k: v for k, v in plain[step].items() if not k.startswith("rollout/")}
            b = {k: v for k, v in sd[step].items() if not k.startswith("rollout/")}
            _assert_same_metrics(a, b, (mode, step))


def _bandit_state(workdir, step):
    """The adaptive engine state in checkpoint ``step``'s controller item (a JSON file)."""
    for p in (workdir / "checkpoints" / str(step) / "controller").rglob("*"):
        if p.is_file():
            try:
                return json.loads(p.read_text())["engine"]["bandit"]
            except (ValueError, KeyError, UnicodeDecodeError):
                continue
    raise AssertionError(f"no bandit state in checkpoint {step}")


@pytest.mark.slow
def test_adaptive_rollouts_report_arm_shares_and_resume_the_bandit(tmp_path):
    """speculative="adaptive": per-step arm shares of the decode steps; the bandit is saved with each checkpoint
    and a resumed run continues it (its window keeps the observations from before the restart)."""
    common = (
        "--config.eval.at_start=False",
        "--config.checkpoint.every_steps=1",
        "--config.rollout.speculative=adaptive",
        "--config.rollout.spec_arms=off,ngram:3x2x6",
        "--config.rollout.spec_epsilon=0.5",
    )
    run(_cfg("tiny.py", "--config.train.num_steps=2", *common), str(tmp_path))
    rows = _train_rows(tmp_path)
    for step in (1, 2):
        shares = {k: v for k, v in rows[step].items() if k.startswith("rollout/arm_share/")}
        assert set(shares) <= {"rollout/arm_share/off", "rollout/arm_share/ngram:3x2x6"} and shares
        assert sum(shares.values()) == pytest.approx(1.0)
        assert np.isfinite(rows[step]["rollout/spec_loss"])  # the bandit's ledger: cost beyond plain decoding
    before = _bandit_state(tmp_path, 2)
    assert before["arms"] == ["off", "ngram:3x2x6"] and sum(before["tokens"]) > 0
    assert before["ledger"][0] > 0  # the loss ledger (rollout.spec_max_loss) is kept and checkpointed
    run(_cfg("tiny.py", "--config.train.num_steps=3", *common), str(tmp_path))
    after = _bandit_state(tmp_path, 3)
    for bucket, window in before["observations"].items():
        assert after["observations"][bucket][: len(window)] == window  # restored, then extended
    assert all(a >= b for a, b in zip(after["tokens"], before["tokens"], strict=True))
    with pytest.raises(ConfigError, match="config.rollout.spec_arms: the checkpoint's bandit arms"):
        run(
            _cfg("tiny.py", "--config.train.num_steps=4", *common[:-2], "--config.rollout.spec_arms=ngram:3x2x6,off"),
            str(tmp_path),
        )


def test_adaptive_spec_takes_the_loss_bound():
    """rollout.spec_max_loss reaches the engine's bandit (0 = no bound)."""
    from tlt_jax.builders import engine_kwargs

    common = ("--config.rollout.speculative=adaptive", "--config.rollout.spec_arms=off,ngram:3x2x6")
    spec = lambda *extra: engine_kwargs(_cfg("tiny.py", *common, *extra), "cpu")["spec"]  # noqa: E731
    assert spec().bandit_config().max_loss == 0.05  # the default
    assert spec("--config.rollout.spec_max_loss=0.2").max_loss == 0.2
    assert spec("--config.rollout.spec_max_loss=0").max_loss is None


def test_unusable_eagle_drafter_is_a_config_error(tmp_path):
    """A drafter directory without a saved drafter, or one made for another policy shape: an error naming the key,
    the path and the warm-up command, before any compile."""
    common = ("--config.rollout.speculative=eagle", "--config.train.num_steps=1", "--config.eval.at_start=False")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"config.rollout.drafter_path: .*empty holds no tlt_drafter.json.*warmup"):
        run(_cfg("tiny.py", *common, f"--config.rollout.drafter_path={empty}"), str(tmp_path / "a"))
    other = _tiny_drafter(_cfg("tiny.py"), tmp_path / "other", hidden_size=32)
    with pytest.raises(ConfigError, match=r"made for another policy \(hidden_size=32, the policy's is 64\).*--out="):
        run(_cfg("tiny.py", *common, f"--config.rollout.drafter_path={other}"), str(tmp_path / "b"))


def test_corrupt_latest_checkpoint_resumes_from_previous(tmp_path, caplog):
    """The run's newest checkpoint is damaged: a warning, resume from the one before, same results as straight."""
    import logging

    common = ("--config.train.num_steps=4", "--config.checkpoint.every_steps=2", "--config.eval.at_start=False")
    run(_cfg("tiny.py", *common), str(tmp_path))
    straight = _train_rows(tmp_path)
    for p in (tmp_path / "checkpoints" / "4" / "train_state").rglob("*"):
        if p.is_file() and p.parent.name == "d":
            p.write_bytes(b"\0garbage")
    with caplog.at_level(logging.WARNING):
        run(_cfg("tiny.py", *common), str(tmp_path))
    assert any("step 4" in r.message and "falling back" in r.message for r in caplog.records)
    again = _train_rows(tmp_path)
    for step in (3, 4):
        _assert_same_metrics(straight[step], again[step], step)
    assert (tmp_path / "checkpoints" / "4").is_dir() and (tmp_path / "checkpoints_unreadable" / "4").is_dir()


def _tree_snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.is_file() and p.read_bytes()) for p in root.rglob("*")}


def test_resume_keeps_the_run_key_and_refuses_another_model(tmp_path, caplog):
    """The checkpointed run key seeds the resumed rollouts: resuming with another train.seed warns and gives the
    uninterrupted run's step. Resuming with another model shape is a ConfigError naming the differing shapes and
    config keys that leaves the workdir as it was (no checkpoint moved, config.json kept)."""
    import logging
    import shutil

    common = (
        "--config.train.num_steps=2",
        "--config.checkpoint.every_steps=1",
        "--config.eval.at_start=False",
        "--config.data.eval_size=8",
        "--config.metrics.tensorboard=False",
    )
    ref = tmp_path / "ref"
    run(_cfg("tiny.py", *common), str(ref))
    before = _tree_snapshot(ref)
    with pytest.raises(ConfigError) as e:
        run(_cfg("tiny.py", *common, "--config.model.tiny.hidden_size=32"), str(ref))
    msg = str(e.value)
    assert "params.embed_tokens.value: checkpoint (64, 64) float32, this run (64, 32) float32" in msg, msg
    assert "model.tiny.hidden_size: 64 -> 32" in msg and "new --workdir" in msg, msg
    assert _tree_snapshot(ref) == before and not (ref / "checkpoints_unreadable").exists()

    resumed = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoints" / "1", resumed / "checkpoints" / "1")
    with caplog.at_level(logging.WARNING):
        run(_cfg("tiny.py", *common, "--config.train.seed=7"), str(resumed))
    assert any("train.seed=7 is not the seed this run started with" in r.getMessage() for r in caplog.records)
    assert sorted(_train_rows(resumed)) == [2]
    _assert_same_metrics(_train_rows(ref)[2], _train_rows(resumed)[2], 2)


def test_rollout_layout_bf16_pallas(tmp_path):
    """rollout.dtype / rollout.attention_impl / rollout.layers reach the engine: it decodes a bfloat16, unstacked copy
    of the float32 policy with the Pallas tree-attention kernel (interpret mode on CPU); the copy is re-made after the
    update (time/reshard_s)."""
    import jax
    import jax.numpy as jnp

    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.distributed import make_mesh

    cfg = _cfg(
        "tiny.py",
        "--config.rollout.dtype=bfloat16",
        "--config.rollout.attention_impl=pallas",
        "--config.rollout.layers=unstacked",
        "--config.train.num_steps=1",
        "--config.eval.at_start=False",
        "--config.eval.max_new_tokens=2",
    )
    mesh = make_mesh(cfg.mesh)
    model, tok = build_model(cfg, mesh)
    engine = build_engine(cfg, model, mesh, build_data(cfg, tok, model.config))
    assert {x.dtype for x in jax.tree.leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(nnx_state(model))} == {jnp.dtype(jnp.float32)}  # masters untouched
    assert nnx_merge(engine).attention_impl == "pallas" and engine.ctx.per_layer_cache
    run(cfg, str(tmp_path))
    row = _train_rows(tmp_path)[1]
    assert np.isfinite(row["train/loss"]) and row["time/reshard_s"] > 0
    with pytest.raises(ConfigError, match="rollout.attention_impl"):
        _cfg("tiny.py", "--config.rollout.attention_impl=triton")
    with pytest.raises(ConfigError, match="rollout.layers"):
        _cfg("tiny.py", "--config.rollout.layers=rolled")
    auto = _cfg("tiny.py").rollout
    assert (auto.layer_layout("gpu"), auto.layer_layout("cpu"), cfg.rollout.layer_layout("cpu")) == (
        "unstacked", "stacked", "unstacked")


def nnx_state(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def nnx_merge(engine):
    from flax import nnx

    return nnx.merge(engine.graphdef, engine.params)


def test_startup_plan_refuses_a_run_that_does_not_fit(tmp_path):
    """train.plan_check=on plans the run at start-up (tlt_jax.plan): one summary line when it fits, and a run whose
    plan exceeds train.device_memory_gb stops with one line naming the keys to change (exit 2), before any step."""
    proc = _cli(tmp_path / "small", "--config.train.plan_check=on", "--config.train.device_memory_gb=0.0001")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out
    line = next(x for x in out.splitlines() if "does not fit" in x)
    assert "change" in line and "mesh.fsdp" in line, line
    assert not (tmp_path / "small" / "metrics.jsonl").exists()
    proc = _cli(tmp_path / "fits", "--config.train.plan_check=on", "--config.train.num_steps=1",
                "--config.eval.at_start=False")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert any(x.startswith("plan: 8 devices") and "peak" in x for x in out.splitlines()), out  # no budget on CPU
