"""benchmarks/gpu_tlt_data.py: gpu_tlt.py's prompts written here as GSM8K files (``--prepare_data``) read back by the
``gsm8k_file`` loader as the very examples reasoning-gym generates, in order; a missing, corrupt or mismatched data
folder is refused before anything loads."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("reasoning_gym")  # preparing generates with it (reading back does not)

import e2e_step  # noqa: E402
import gpu_tlt  # noqa: E402
import gpu_tlt_data as data  # noqa: E402

from tlt_jax.builders import build_data  # noqa: E402
from tlt_jax.data import PromptFormatter, gsm_symbolic_splits  # noqa: E402

TRAIN = 100  # a small RL training set (the GPU run's is configs/gsm8k.py's 1000)


class FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text):
        return list(text.encode())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_data") / "data"
    assert gpu_tlt.main([f"--prepare_data={out}", f"--set=data.train_size={TRAIN}"]) == 0
    return out


def _examples(name, extra):
    d = build_data(e2e_step.load_config(name, extra), FakeTokenizer(), None)
    return [[(ex["prompt_text"], ex["ground_truth"], ex["prompt_ids"]) for ex in part] for part in (d.train, d.eval)]


def test_files_read_back_as_the_generated_examples(prepared):
    manifest = data.check(prepared)
    assert manifest["rl"]["source"] == "arithmetic" and manifest["rl"]["instruction"] == "answer_is"
    rows = manifest["rl"]["train"]["rows"], manifest["rl"]["eval"]["rows"], manifest["decode"]["rows"]
    assert rows == (TRAIN, 8, 64)
    # the RL cells: configs/gsm8k.py with gpu_tlt's overrides, generated vs read from the files as gsm8k_file
    args = gpu_tlt.parse([f"--set=data.train_size={TRAIN}", "--model=/nowhere/policy.gguf"])
    name, extra = gpu_tlt.rl_setup(args, True)
    files = data.rl_overrides(prepared, manifest, gpu_tlt.rl_data_config(name, extra))
    assert files["data.source"] == "gsm8k_file" and Path(files["data.train_path"]).is_file()
    generated, read = _examples(name, extra), _examples(name, {**extra, **files})
    assert [len(p) for p in read] == [TRAIN, 8] and read == generated
    assert read[0][0][0].startswith("<system>Think step by step.")  # the arithmetic source's instruction
    # the decoding cells: load_policy_and_prompts(..., "eval")'s held-out problems, formatted the same way
    fmt = PromptFormatter(chat_template=FakeTokenizer().apply_chat_template)
    want = [ex["prompt_text"] for ex in gsm_symbolic_splits(1, 64, formatter=fmt).eval]
    assert [ex["prompt_text"] for ex in data.decode_questions(prepared, fmt, 64)] == want


def test_missing_corrupt_or_mismatched_data_is_refused(prepared, tmp_path, capsys, monkeypatch):
    out = f"--out={tmp_path / 'tlt.json'}"
    assert gpu_tlt.main([f"--data_dir={tmp_path / 'missing'}", out]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--prepare_data" in err and not (tmp_path / "tlt.json").exists()
    (tmp_path / "partial").mkdir()
    assert gpu_tlt.main([f"--data_dir={tmp_path / 'partial'}", out]) == 2
    assert "has no data.json" in capsys.readouterr().err
    # prepared for other RL data (a run's --set that the preparation did not have)
    assert gpu_tlt.main([f"--data_dir={prepared}", "--set=data.train_size=150", "--model=/nowhere/p.gguf", out]) == 2
    err = capsys.readouterr().err
    assert f"train_size: {TRAIN} there, 150 here" in err and "--prepare_data" in err
    # a corrupt file
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in prepared.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "eval.jsonl").write_text((bad / "eval.jsonl").read_text().replace("Calculate", "Compute"))
    assert gpu_tlt.main([f"--data_dir={bad}", out]) == 2
    assert "eval.jsonl is corrupt" in capsys.readouterr().err
    # no reasoning-gym and no --data_dir (the GPU image)
    monkeypatch.setattr(gpu_tlt.importlib.util, "find_spec", lambda name, *a: None)
    assert gpu_tlt.main(["--model=/nowhere/p.gguf", out]) == 2
    assert "reasoning_gym is not installed" in capsys.readouterr().err
    assert json.loads((prepared / "data.json").read_text())["format"] == data.FORMAT
