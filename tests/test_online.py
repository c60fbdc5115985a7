"""TLT's adaptive drafter in the main job (configs/tiny.py, 8 simulated CPU devices): online drafter training and
rollout slices leave the RL run unchanged, the drafter state resumes exactly, and online training raises the accept
length of a fresh drafter."""

import json

import jax
import numpy as np
import pytest
from test_main import _assert_same_metrics, _cfg, _tiny_drafter, _train_rows

from tlt_jax.config import ConfigError
from tlt_jax.controller import TIMELINE_FILE
from tlt_jax.main import run

# Small EAGLE trees (fast compiles); the tiny policy's 16-token responses are captured whole.
TREE = ("--config.rollout.speculative=eagle", "--config.rollout.spec_depth=3", "--config.rollout.spec_topk=2",
        "--config.rollout.spec_verify_tokens=6", "--config.drafter.row_len=64", "--config.drafter.window=16")
QUIET = ("--config.eval.at_start=False", "--config.metrics.tensorboard=False")
# What may differ between runs that sample the same tokens: timings, speculation and drafter-training counters.
SPEC_ONLY = ("rollout/", "drafter/", "controller/", "buffer/")


def _rl_only(row):
    return {k: v for k, v in row.items() if not k.startswith(SPEC_ONLY)}


def _exported_weights(workdir):
    from safetensors.numpy import load_file

    return load_file(str(workdir / "drafter_eagle" / "model.safetensors"))


def _assert_export_is_the_trained_drafter(workdir, step, start):
    """The EAGLE-layout export at the end of the run holds the trained drafter's values: read back (layout inverted),
    every tensor equals the trainable params of the drafter state in the run's last checkpoint (the replicas'
    average, what the trainer holds), and training moved them away from the ``start`` drafter."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from tlt_jax.drafter import import_eagle, load_drafter

    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(workdir / "checkpoints" / str(step) / "extra_drafter")  # SpotTrainer.state_tree()
    exported = [np.asarray(x) for x in jax.tree.leaves(nnx.state(import_eagle(workdir / "drafter_eagle"), nnx.Param))]
    initial = [np.asarray(x) for x in jax.tree.leaves(nnx.state(load_drafter(start), nnx.Param))]
    trained = [np.asarray(state[f"{i:05d}"]) for i in range(len(exported))]  # the params lead the train state
    assert len(state) > len(exported)  # then the optimizer state and step count
    for x, y, z in zip(exported, trained, initial, strict=True):
        assert x.shape == y.shape == z.shape and x.dtype == y.dtype == np.float32
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(exported, initial, strict=True))


def test_online_drafter_trains_on_a_bfloat16_rollout_copy(tmp_path):
    """TLT's layout: the engine decodes a bfloat16 copy of the float32 policy (rollout.dtype) and the drafter trains
    online on that copy's hidden states (computed in bfloat16, as with a float32 copy): the RL metrics are those of
    the same run without online training (lossless) and the drafter trains. (A resume restores the drafter exactly:
    test_resume_restores_the_drafter_exactly.)"""
    drafter = _tiny_drafter(_cfg("tiny.py"), tmp_path / "drafter")
    common = ("--config.train.num_steps=2", *QUIET, *TREE, f"--config.rollout.drafter_path={drafter}",
              "--config.rollout.dtype=bfloat16")
    online = ("--config.drafter.online=True", "--config.drafter.lr=3e-3")
    run(_cfg("tiny.py", *common), str(tmp_path / "off"))
    run(_cfg("tiny.py", *common, *online), str(tmp_path / "on"))
    off, on = _train_rows(tmp_path / "off"), _train_rows(tmp_path / "on")
    for step in (1, 2):
        _assert_same_metrics(_rl_only(off[step]), _rl_only(on[step]), step)
        assert on[step]["drafter/steps"] >= 4 and np.isfinite(on[step]["drafter/loss"]), on[step]
    assert on[2]["drafter/buffer_tokens"] > 0  # the copy's hidden states, buffered


@pytest.mark.slow
def test_online_drafter_and_slices_leave_rl_metrics_unchanged(tmp_path):
    """Same drafter to start with: online training off / on (1 slice) and on with 2 slices, hot-swapping each new
    replica into the slice still decoding, give identical rewards, losses and KL at every step (verification is
    lossless and sampling keys follow the prompt's global index); drafter steps, controller times and the timeline
    are recorded, the adapted drafter is exported with the trained values."""
    drafter = _tiny_drafter(_cfg("tiny.py"), tmp_path / "drafter")
    common = ("--config.train.num_steps=2", *QUIET, *TREE, f"--config.rollout.drafter_path={drafter}")
    runs = {
        "off": (),
        "on": ("--config.drafter.online=True", "--config.drafter.lr=3e-3"),
        "on2": ("--config.drafter.online=True", "--config.drafter.lr=3e-3", "--config.rollout.num_slices=2",
                "--config.drafter.hot_swap=True", "--config.drafter.steps_without_idle=4"),
    }
    for name, overrides in runs.items():
        run(_cfg("tiny.py", *common, *overrides), str(tmp_path / name))
    rows = {name: _train_rows(tmp_path / name) for name in runs}
    for step in (1, 2):
        for name in ("on", "on2"):
            _assert_same_metrics(_rl_only(rows["off"][step]), _rl_only(rows[name][step]), (name, step))
            r = rows[name][step]
            assert r["drafter/steps"] >= 4 and np.isfinite(r["drafter/loss"]), (name, step, r)
            assert r["drafter/buffer_tokens"] > 0 and r["drafter/dropped"] == 0
            assert r["controller/busy_s"] > 0 and r["controller/train_s"] > 0
            # what drafter work added after the last shard: the steps after the rollout and the replicas' average
            assert r["drafter/critical_s"] >= r["controller/overhang_s"] > 0, (name, step, r)
            # deferred compiles: after the rollout and the drafter work in flight at its end
            assert r["controller/compile_release_s"] >= r["controller/overhang_s"], (name, step, r)
        assert "drafter/steps" not in rows["off"][step]
    # Whether a drafter step ends while the other slice still decodes depends on timing (all responses here are 16
    # tokens): each drafter step swaps its replica into at most the one other slice. The swap drafting is tested
    # deterministically below and in test_hot_swap.py.
    for s in (1, 2):
        swaps = rows["on2"][s]["controller/hot_swaps"]
        assert swaps == int(swaps) and 0 <= swaps <= rows["on2"][s]["controller/train_steps"], rows["on2"][s]
    assert "controller/hot_swaps" not in rows["on"][1]
    assert rows["on"][2]["drafter/total_steps"] == 8  # 4 steps after each rollout (steps_without_idle)
    timeline = [json.loads(line) for line in (tmp_path / "on2" / TIMELINE_FILE).read_text().splitlines()]
    assert {(t["step"], t["slice"]) for t in timeline} == {(s, i) for s in (1, 2) for i in (0, 1)}
    assert {t["state"] for t in timeline} >= {"busy", "training"}
    for name in ("on", "on2"):
        assert sorted(_exported_weights(tmp_path / name)) == sorted(_exported_weights(tmp_path / "on"))
        _assert_export_is_the_trained_drafter(tmp_path / name, 2, drafter)
    assert not (tmp_path / "off" / "drafter_eagle").exists()


@pytest.mark.slow
def test_resume_restores_the_drafter_exactly(tmp_path):
    """A run stopped after step 2 and resumed equals the uninterrupted run, drafter loss and weights included (the
    drafter's params + optimizer state are in the checkpoint, its data buffer next to it)."""
    common = (*QUIET, *TREE, "--config.drafter.online=True", "--config.drafter.lr=3e-3",
              "--config.checkpoint.every_steps=2")
    run(_cfg("tiny.py", *common, "--config.train.num_steps=4"), str(tmp_path / "full"))
    run(_cfg("tiny.py", *common, "--config.train.num_steps=2"), str(tmp_path / "cut"))
    assert sorted(p.name for p in (tmp_path / "cut" / "drafter_buffer").iterdir()) == ["step_2.npz"]
    run(_cfg("tiny.py", *common, "--config.train.num_steps=4"), str(tmp_path / "cut"))
    full, cut = _train_rows(tmp_path / "full"), _train_rows(tmp_path / "cut")
    for step in (3, 4):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("controller/", "rollout/"))}
        _assert_same_metrics(keep(full[step]), keep(cut[step]), step)
        assert full[step]["rollout/accept_length"] == cut[step]["rollout/accept_length"]
    a, b = _exported_weights(tmp_path / "full"), _exported_weights(tmp_path / "cut")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_online_config_errors(tmp_path):
    """Keys that cannot work name themselves and the fix, before any compile."""
    with pytest.raises(ConfigError, match=r"config.drafter.online: .*rollout.speculative='off'.*speculative=eagle"):
        _cfg("tiny.py", "--config.drafter.online=True")
    with pytest.raises(ConfigError, match=r"config.rollout.drafter_path: .*needs a drafter: .*drafter.online=True"):
        _cfg("tiny.py", "--config.rollout.speculative=eagle")
    with pytest.raises(ConfigError, match=r"config.rollout.num_slices: must be >= 1 engines, or -1"):
        _cfg("tiny.py", "--config.rollout.num_slices=0")
    with pytest.raises(ConfigError, match=r"config.drafter.buffer_bytes: must be > 0"):
        _cfg("tiny.py", "--config.drafter.buffer_bytes=0")
    with pytest.raises(ConfigError, match=r"config.drafter.prompt_context: must be >= 0 prompt positions"):
        _cfg("tiny.py", "--config.drafter.prompt_context=-1")
    with pytest.raises(ConfigError,
                       match=r"config.rollout.num_slices: 3 rollout engines do not split the mesh.s 8 tensor-parallel"):
        run(_cfg("tiny.py", *QUIET, "--config.rollout.num_slices=3", "--config.train.num_steps=1"), str(tmp_path))
    with pytest.raises(ConfigError, match=r"config.drafter.rows: 4 does not split over a slice's 8 .*multiple of 8"):
        run(_cfg("tiny.py", *QUIET, *TREE, "--config.drafter.online=True", "--config.drafter.rows=4",
                 "--config.train.num_steps=1"), str(tmp_path / "b"))


def test_prompt_context_reaches_the_drafter_buffer(tmp_path):
    """drafter.prompt_context: each buffered window (whole responses here: drafter.window is the cap of 16) starts
    that many positions before the prompt's last token (capped by the 8-token prompts), as context, not targets."""
    for ctx, want in ((0, 0), (3, 3), (128, 7)):
        run(_cfg("tiny.py", *QUIET, *TREE, "--config.drafter.online=True", "--config.train.num_steps=1",
                 f"--config.drafter.prompt_context={ctx}"), str(tmp_path / str(ctx)))
        with np.load(tmp_path / str(ctx) / "drafter_buffer" / "step_1.npz") as z:
            assert len(z["lengths"]) > 0 and set(z["response_starts"].tolist()) == {1 + want}, ctx
            assert (z["lengths"] >= want + 2).all(), ctx  # the context plus >= 2 positions from the prompt's last


@pytest.mark.slow
def test_online_training_raises_the_accept_length_of_a_fresh_drafter(tmp_path):
    """From a freshly initialised drafter, while the tiny policy converges on its target token: with 8 drafter steps
    after every rollout the accept length climbs; with none (steps_without_idle=0 on one slice: no slice is ever
    idle) it falls. At T = 1 the random policy starts near uniform, where a random drafter's coupled samples (drafted
    under the verifier's noise) match it about as well as any; once the policy has converged only a trained drafter
    keeps up. The final greedy held-out evaluation tells them apart too."""
    common = ("--config.train.num_steps=16", *QUIET, *TREE, "--config.drafter.online=True", "--config.drafter.lr=3e-3",
              "--config.checkpoint.every_steps=100")
    final = {"adapt": run(_cfg("tiny.py", *common, "--config.drafter.steps_without_idle=8"), str(tmp_path / "adapt")),
             "static": run(_cfg("tiny.py", *common, "--config.drafter.steps_without_idle=0"), str(tmp_path / "static"))}
    acc = {name: [r["rollout/accept_length"] for _, r in sorted(_train_rows(tmp_path / name).items())]
           for name in ("adapt", "static")}
    steps = {name: [r["drafter/steps"] for r in _train_rows(tmp_path / name).values()] for name in acc}
    assert set(steps["adapt"]) == {8.0} and set(steps["static"]) == {0.0}
    print({k: np.round(v, 2).tolist() for k, v in acc.items()})
    first, last = (lambda a: np.mean(a[:3])), (lambda a: np.mean(a[-3:]))
    assert last(acc["adapt"]) > first(acc["adapt"]) + 0.5, acc
    assert last(acc["static"]) < first(acc["static"]) - 0.5, acc
    assert last(acc["adapt"]) > 1.5 * last(acc["static"]), acc
    # drafter/top1: agreement with the policy on the step's own responses, which the scoring drafter never saw.
    top1 = {name: [r["drafter/top1"] for _, r in sorted(_train_rows(tmp_path / name).items())] for name in acc}
    print({k: np.round(v, 2).tolist() for k, v in top1.items()})
    assert last(top1["adapt"]) > first(top1["adapt"]) + 0.3 and last(top1["static"]) < 0.3, top1
    # The final greedy evaluation (same held-out prompts, same final policy in both runs) tells the drafters apart too.
    held_out = {name: f["eval/accept_length"] for name, f in final.items()}
    assert held_out["adapt"] > 1.5 * held_out["static"], held_out


@pytest.mark.slow
def test_drafter_swapped_mid_rollout_keeps_every_sample():
    """The hot swap's premise: an engine reads its drafter at every chunk, so set_drafter between two chunks of a
    running generate (as the controller does for slices still decoding) takes effect mid-rollout: the next chunk
    rebuilds the drafter cache with the new weights, and the samples (T = 1, a 2-wide tree, six rows) are those of
    either drafter alone (verification is lossless). That the new drafter drafts: test_hot_swap.py."""
    import jax
    from flax import nnx

    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.drafter import EagleDrafter
    from tlt_jax.models import CausalLM, tiny_config
    from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

    model = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    a, b = EagleDrafter(model.config, rngs=nnx.Rngs(2)), EagleDrafter(model.config, rngs=nnx.Rngs(3))
    engine = RolloutEngine(model, make_mesh(MeshConfig(data=1), jax.devices()[:1]), drafter=a,
                           spec=SpecConfig(depth=3, topk=2, verify_tokens=6, threshold=16), max_batch=16, max_len=64,
                           chunk_size=4, length_buckets=(64,), compaction=False,
                           compiler_options={"xla_backend_optimization_level": 0})
    prompts = [[5, 9, 17, 33], [2, 20, 7], [40, 41, 42]]
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=24, ignore_eos=True, seed=7)
    only_a = engine.generate(prompts, sampling)
    engine.set_drafter(b)
    only_b = engine.generate(prompts, sampling)
    b_leaves = [np.asarray(x) for x in jax.tree.leaves(engine.drafter_params)]
    engine.set_drafter(a)
    at_swap = []

    def swap(finished, active):
        at_swap.append(active)
        if len(at_swap) == 2:  # before the second round trip: the first drafted with a
            engine.set_drafter(b)

    swapped = engine.generate(prompts, sampling, on_chunk=swap)
    assert len(at_swap) > 2 and at_swap[1] > 0  # swapped while samples were still decoding
    assert swapped.tokens == only_a.tokens == only_b.tokens
    chunks = swapped.stats["chunks"]
    assert [i for i, c in enumerate(chunks) if c.get("drafter_swapped")] == [1]
    assert all(c["arm"] != "plain" for c in chunks[:2]) and swapped.stats["verify_steps"] > 0
    after = [np.asarray(x) for x in jax.tree.leaves(engine.drafter_params)]
    assert all(np.array_equal(x, y) for x, y in zip(after, b_leaves, strict=True))
