"""Config files load and validate; unknown keys, wrong types and invalid values give errors that name the key."""

import json
import pathlib

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from tlt_jax.config import Config, ConfigError, config_file, from_config_dict, to_config_dict, to_json

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def _parse(argv):
    """absl + config_flags exactly as tlt_jax.main uses them (overrides are read from argv)."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


def _load(name):
    return _parse(["prog", f"--config={CONFIGS / name}"])


@pytest.mark.parametrize("name", ["base.py", "tiny.py", "tiny_tlt.py", "gsm8k.py"])
def test_config_files_validate(name):
    cfg = from_config_dict(_load(name))
    assert isinstance(cfg, Config)
    assert cfg.rollout.samples_per_prompt >= 2
    # Every config documents its exact command.
    text = (CONFIGS / name).read_text()
    assert "python -m tlt_jax.main --config=configs/" in text


def test_every_derived_config_uses_the_shared_helper_and_a_user_config_can_derive(tmp_path):
    for path in CONFIGS.glob("*.py"):
        if path.name != "base.py":
            assert "config_file(__file__, " in path.read_text() and "importlib" not in path.read_text(), path.name
    # A config of the user's own, beside a copy of tiny.py and base.py, derives from tiny and overrides one key.
    for name in ("base.py", "tiny.py"):
        (tmp_path / name).write_text((CONFIGS / name).read_text())
    (tmp_path / "mine.py").write_text(
        "from tlt_jax.config import config_file\n\ntiny = config_file(__file__, 'tiny')\n\n\n"
        "def get_config():\n    c = tiny.get_config()\n    c.optim.lr = 0.25\n    return c\n")
    cfg = from_config_dict(_parse(["prog", f"--config={tmp_path / 'mine.py'}"]))
    assert cfg.optim.lr == 0.25 and cfg.data.source == from_config_dict(_load("tiny.py")).data.source
    assert config_file(str(tmp_path / "mine.py"), "tiny.py").get_config().optim.lr != 0.25  # a fresh copy each time
    (tmp_path / "base.py").unlink()
    with pytest.raises(ConfigError, match=r"derives from base\.py, which is not in"):
        config_file(str(tmp_path / "mine.py"), "tiny")


@pytest.mark.parametrize("name,batch,mesh,target,engines", [
    ("qwen2p5_7b_gsm8k.py", (64, 16), (1, 2, 4), "h100:1x8", 2),
    ("qwen2p5_32b_gsm8k.py", (256, 32), (1, 8, 8), "h100:8x8", 8),
])
def test_gpu_recipes_need_paths_and_are_tlt(name, batch, mesh, target, engines):
    """The GPU recipes validate once given a model and data path (placeholders: nothing is read) and are TLT's:
    GRPO hyper-parameters, adaptive speculation over TLT's EAGLE arms at <= 32 live rows, the online drafter, a bfloat16
    rollout copy with the tree-attention kernel, one rollout engine per tensor-parallel group (2 of TP 4 on one 8-GPU
    node; 8 of TP 8, one per node, on 8 nodes), each on one node of the compile-only target's devices; each documents
    its command."""
    from tlt_jax.adaptive.arms import parse_arms
    from tlt_jax.distributed import engine_meshes, make_mesh
    from tlt_jax.rl.learner import check_micro_batch

    cd = _load(name)
    with pytest.raises(ConfigError, match="config.model.path"):
        from_config_dict(cd)
    cd.model.path = "/models/Qwen2.5"
    cd.data.train_path = "/data/gsm8k/train.parquet"
    cfg = from_config_dict(cd)
    assert (cfg.data.prompts_per_step, cfg.updates_per_step, cfg.rollout.samples_per_prompt) == (*batch, 8)
    assert cfg.rollout.temperature == 0.9 and cfg.optim.lr == 1e-6
    assert (cfg.rl.kl_coef, cfg.rl.kl_kind) == (0.001, "low_var_kl")
    r = cfg.rollout
    assert (r.speculative, r.spec_threshold, r.num_slices, cfg.drafter.online) == ("adaptive", 32, -1, True)
    assert r.dtype == "bfloat16" and cfg.model.dtype == "bfloat16"  # the engines' copy, as SGLang's
    assert r.attention_impl == "pallas"  # the Triton tree-attention kernel in decode and verify
    assert cfg.checkpoint.every_minutes == 30  # beside every_steps: long steps, so a wall-clock bound too
    assert [str(a) for a in parse_arms(r.spec_arms)] == ["off"] + [f"eagle:8x4x{n}" for n in (48, 32, 16, 8)]
    text = (CONFIGS / name).read_text()
    assert f"python -m tlt_jax.main --config=configs/{name}" in text and "python -m tlt_jax.drafter.warmup" in text
    try:
        from tlt_jax.plan.targets import compile_only_devices

        devices = compile_only_devices(target)
    except ImportError:
        pytest.skip("needs jax-cuda12-plugin (compile-only H100s)")
    m = make_mesh(cfg.mesh, devices)
    assert tuple(m.shape.values()) == mesh
    check_micro_batch(cfg, m)
    meshes = engine_meshes(m, r.num_slices)
    assert len(meshes) == engines and all(e.shape["tensor"] == mesh[2] for e in meshes)
    assert all(len({d.process_index for d in e.devices.flat}) == 1 for e in meshes)


def test_slurm_script_runs_the_recipe_it_is_given(tmp_path):
    """launch/slurm/train.sbatch: RECIPE=7b (default) / 32b picks configs/qwen2p5_{7b,32b}_gsm8k.py and its workdir
    (stand-ins for srun and the task print the command it runs)."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "task").write_text('#!/bin/bash\necho "task $*"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = CONFIGS.parent / "launch" / "slurm" / "train.sbatch"
    for recipe, want in (("", "qwen2p5_7b_gsm8k"), ("32b", "qwen2p5_32b_gsm8k")):
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", MODEL="/m", DATA="/d",
                   SLURM_JOB_ID="7", PYTHON=str(bin_dir / "task"), RECIPE=recipe)
        if not recipe:
            env.pop("RECIPE")
        out = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"--config=configs/{want}.py" in out.stdout and f"--workdir=runs/{want}-7" in out.stdout, out.stdout
        assert (CONFIGS / f"{want}.py").is_file()


def test_command_line_overrides_and_locked_unknown_key():
    tiny = f"--config={CONFIGS / 'tiny.py'}"
    cd = _parse(["prog", tiny, "--config.optim.lr=0.5", "--config.train.debug_nan_steps=(2, 3)"])
    cfg = from_config_dict(cd)
    assert cfg.optim.lr == 0.5 and cfg.train.debug_nan_steps == (2, 3)
    with pytest.raises(Exception, match="lrr"):  # a locked ConfigDict refuses new keys at parse time
        _parse(["prog", tiny, "--config.optim.lrr=0.5"])
    with pytest.raises(Exception, match="lr"):  # and ill-typed values
        _parse(["prog", tiny, "--config.optim.lr=fast"])


def test_unknown_key_lists_valid_names():
    cd = to_config_dict()
    d = cd.to_dict()
    d["rl"]["klcoef"] = 0.1
    with pytest.raises(ConfigError) as e:
        from_config_dict(d)
    msg = str(e.value)
    assert "config.rl" in msg and "klcoef" in msg and "kl_coef" in msg and "micro_batch_size" in msg
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['bogus'\].*valid keys: \['checkpoint'"):
        from_config_dict({"bogus": 1})


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (("optim", "lr"), "fast", r"config.optim.lr: expected float, got 'fast' \(str\)"),
        (("rollout", "samples_per_prompt"), 4.5, r"config.rollout.samples_per_prompt: expected int, got 4.5"),
        (("checkpoint", "async_save"), 1, r"config.checkpoint.async_save: expected bool, got 1 \(int\)"),
        (("train", "debug_nan_steps"), ("a",), r"config.train.debug_nan_steps\[0\]: expected int, got 'a'"),
        (("data", "synthetic"), 3, r"config.data.synthetic: expected a block of SyntheticDataConfig fields"),
    ],
)
def test_wrong_type_names_key_expected_and_got(path, value, expect):
    d = to_config_dict().to_dict()
    d[path[0]][path[1]] = value
    with pytest.raises(ConfigError, match=expect):
        from_config_dict(d)


def test_int_is_accepted_for_float():
    d = to_config_dict().to_dict()
    d["optim"]["lr"] = 1
    assert from_config_dict(d).optim.lr == 1.0


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (("rollout", "samples_per_prompt"), 1, "GRPO groups need >= 2"),
        (("rl", "kl_kind"), "k9", r"unknown 'k9'; choose from"),
        (("rl", "advantage"), "ppo", r"config.rl.advantage: unknown 'ppo'"),
        (("rl", "micro_batch_size"), 3, r"config.rl.micro_batch_size: 3 must divide the sequences per update"),
        (("rl", "mini_batch_prompts"), 3, r"must divide data.prompts_per_step"),
        (("optim", "lr"), -1.0, "config.optim.lr: must be > 0"),
        (("optim", "schedule"), "step", "config.optim.schedule: must be one of"),
        (("data", "source"), "gsm_symbolic", "a random tiny model only fits 'synthetic' data"),
        (("model", "source"), "path", "config.model.path: give a path exactly when source='path'"),
        (("checkpoint", "max_to_keep"), 1, "keep >= 2"),
        (("rollout", "speculative"), "medusa", r"config.rollout.speculative: must be one of \(.*'eagle', 'adaptive'\)"),
        (("rollout", "speculative"), "eagle", r"rollout.drafter_path: speculative='eagle' needs a drafter: a shipped"),
        (("rollout", "spec_depth"), 0, r"config.rollout.spec_depth: must be >= 1"),
        (("rollout", "spec_topk"), 0, r"config.rollout.spec_topk: must be >= 1"),
        (("rollout", "spec_verify_tokens"), 1, r"config.rollout.spec_verify_tokens: must be in \[2, 117\]"),
        (("rollout", "spec_verify_tokens"), 118, r"config.rollout.spec_verify_tokens: must be in \[2, 117\]"),
        (("rollout", "spec_arms"), "off,ngram:3x2x6", r"config.rollout.spec_arms: is only used with speculative='adap"),
        (("rollout", "speculative"), "adaptive", r"config.rollout.spec_arms: speculative='adaptive' needs the bandit"),
        (("mesh", "fsdp"), 0, "config.mesh: invalid mesh shape"),
        (("rollout", "top_k"), 8, r"config.rollout.top_k: must be 0 \(off\) for RL rollouts, got 8: .*full distrib"),
        (("rollout", "top_p"), 0.9, r"config.rollout.top_p: must be 1.0 \(off\) for RL rollouts, got 0.9: .*generate"),
    ],
)
def test_invalid_values(path, value, expect):
    d = to_config_dict().to_dict()
    d[path[0]][path[1]] = value
    with pytest.raises(ConfigError, match=expect):
        from_config_dict(d)


def test_eagle_drafter_path_must_be_a_directory(tmp_path):
    d = to_config_dict().to_dict()
    d["rollout"].update(speculative="eagle", drafter_path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"drafter_path: '.*nope' is neither a directory nor a shipped.*warmup"):
        from_config_dict(d)
    d["rollout"].update(drafter_path=str(tmp_path), spec_depth=3, spec_topk=2, spec_verify_tokens=12)
    with pytest.raises(ConfigError, match=r"config.rollout.spec_verify_tokens: must be in \[2, 11\]"):
        from_config_dict(d)  # 1 + topk + (depth - 1) * topk^2 = 11
    d["rollout"]["spec_verify_tokens"] = 11
    r = from_config_dict(d).rollout
    assert (r.speculative, r.drafter_path, r.spec_verify_tokens) == ("eagle", str(tmp_path), 11)


def test_json_round_trip_and_frozen():
    cfg = from_config_dict(_load("gsm8k.py"))
    again = from_config_dict(json.loads(to_json(cfg)))
    assert again == cfg and hash(again.rl) == hash(cfg.rl)
    with pytest.raises(AttributeError):
        cfg.rl.kl_coef = 0.5  # frozen
    assert isinstance(to_config_dict(cfg), ml_collections.ConfigDict)


def _tlt_imports(path: pathlib.Path) -> set[str]:
    """Every tlt_jax module a file imports, at module level or inside functions."""
    import ast

    from test_imports import parse_file

    out = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tlt_jax")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tlt_jax"):
            out.add(node.module)
    return out


def test_config_and_rewards_do_not_import_rl_and_names_match_the_registries():
    """config -> rl and rewards -> {rl, config} never happen (rl imports both: no package cycle); the name lists
    the config validates against are exactly the rl registries."""
    import subprocess
    import sys

    from tlt_jax import config
    from tlt_jax.rl import ADVANTAGE_FNS, KL_ESTIMATORS, LOSS_AGG_FNS, POLICY_LOSS_FNS

    pkg = CONFIGS.parent / "tlt_jax"
    assert not {m for m in _tlt_imports(pkg / "config.py") if m.startswith(("tlt_jax.rl", "tlt_jax.rewards"))}
    for f in (pkg / "rewards").glob("*.py"):
        assert not {m for m in _tlt_imports(f) if m.startswith(("tlt_jax.rl", "tlt_jax.config"))}, f
    code = (
        "import sys; import tlt_jax.rewards; "
        "assert not [m for m in sys.modules if m.startswith(('tlt_jax.rl', 'tlt_jax.config'))]; "
        "import tlt_jax.config; assert not [m for m in sys.modules if m.startswith('tlt_jax.rl')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONFIGS.parent)
    pairs = [
        (config.ADVANTAGES, ADVANTAGE_FNS),
        (config.POLICY_LOSSES, POLICY_LOSS_FNS),
        (config.LOSS_AGG_MODES, LOSS_AGG_FNS),
        (config.KL_KINDS, KL_ESTIMATORS),
    ]
    for names, registry in pairs:
        assert sorted(names) == sorted(registry)


def test_adaptive_rollout_keys(tmp_path):
    d = to_config_dict().to_dict()
    d["rollout"].update(speculative="adaptive", spec_arms="off,ngram:3x2x12")
    with pytest.raises(ConfigError, match=r"config.rollout.spec_arms: arm 'ngram:3x2x12': .*must be in \[2, 11\]"):
        from_config_dict(d)
    d["rollout"].update(spec_arms="off,eagle:3x2x6")
    with pytest.raises(ConfigError, match=r"config.rollout.drafter_path: an 'eagle:' arm needs a drafter"):
        from_config_dict(d)
    d["rollout"].update(drafter_path=str(tmp_path))
    for key, value, match in [
        ("spec_epsilon", 1.5, r"in \[0, 1\]"),
        ("spec_window", 0, ">= 1"),
        ("spec_patience", -1, ">= 0"),
        ("spec_max_loss", 1.5, r"in \[0, 1\] \(a fraction of plain decoding's time; 0 = no bound\)"),
        ("spec_max_loss", -0.1, r"in \[0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=rf"config.rollout.{key}: must be {match}"):
            from_config_dict({**d, "rollout": {**d["rollout"], key: value}})
    r = from_config_dict({**d, "rollout": {**d["rollout"], "spec_patience": 2}}).rollout
    assert (r.speculative, r.spec_arms, r.spec_patience) == ("adaptive", "off,eagle:3x2x6", 2)
    # the loss bound is against plain decoding: it needs the "off" arm (or no bound)
    with pytest.raises(ConfigError, match=r"config.rollout.spec_max_loss: bounds the loss .* must include 'off'"):
        from_config_dict({**d, "rollout": {**d["rollout"], "spec_arms": "eagle:3x2x6,eagle:2x1x3"}})
    r = from_config_dict({**d, "rollout": {**d["rollout"], "spec_arms": "eagle:3x2x6", "spec_max_loss": 0.0}})
    assert r.rollout.spec_max_loss == 0.0


def test_config_methods_read_only_fields_they_have():
    """Every ``self.X`` a config section's method reads is a field or method of that section (a method copied from
    another section, reading that section's field, fails on first use with an AttributeError)."""
    import ast
    import dataclasses
    import inspect
    import textwrap
    import typing

    sections, todo = [], [Config]
    while todo:
        cls = todo.pop()
        sections.append(cls)
        todo += [t for t in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(t)]
    missing = []
    for cls in sections:
        names = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
        for name, fn in vars(cls).items():
            if not inspect.isfunction(fn) or name.startswith("__"):
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Name) and n.value.id == "self"}
            missing += [f"{cls.__name__}.{name} reads self.{a}" for a in sorted(reads - names)]
    assert len(sections) > 10 and not missing, missing
