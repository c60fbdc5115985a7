"""``gpu_tlt.py``'s prompts as files, for a machine without reasoning-gym (the GPU image cannot install it):

    python benchmarks/gpu_tlt.py --prepare_data=DIR   # here, with gpu_tlt's RL flags (--prompts, --set)
    python3 benchmarks/gpu_tlt.py --data_dir=DIR ...   # there: nothing imports reasoning_gym

DIR (about 0.1 MiB) holds GSM8K-format ``.jsonl`` files (``{"question", "answer": "#### N", "id"}``, read as
``data.source="gsm8k_file"``): ``decode.jsonl`` (the decoding cells' held-out gsm_symbolic prompts), ``train.jsonl``
/ ``eval.jsonl`` (the very examples, in order, that the RL config's data block generates) and ``data.json`` (what was
generated and each file's sha256). ``prepare`` reads every file back and checks it; a run checks the files and that
its RL config asks for the same data, and refuses otherwise, naming the difference and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

FORMAT = "tlt_jax.gpu_tlt_data.v1"
MANIFEST = "data.json"
DECODE_TASK = "gsm_symbolic"  # the decoding cells' prompts (speculative.py's workload)
RL_KEYS = ("source", "train_size", "eval_size", "train_seed", "eval_seed", "instruction")
FIX = "run `python benchmarks/gpu_tlt.py --prepare_data=DIR` (with the run's RL flags) where reasoning-gym is installed"


class DataError(RuntimeError):
    """The data folder is missing, incomplete, corrupt or was prepared for another RL config."""


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place: a reader never sees a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def rl_key(data_cfg) -> dict | None:
    """What the RL cells' data block generates (None: a source that needs no generator, e.g. gsm8k_file)."""
    from tlt_jax.data import GENERATED_TASKS
    from tlt_jax.data.prompts import instruction_name

    if data_cfg.source not in GENERATED_TASKS:
        return None
    key = {k: getattr(data_cfg, k) for k in RL_KEYS}
    key["instruction"] = instruction_name(data_cfg.source, data_cfg.instruction)
    return key


def _file(out: Path, name: str, examples: list[dict]) -> dict:
    """``examples`` written to out/name in the GSM8K format, read back through ``load_gsm8k_file`` and checked: the
    manifest's entry of the file."""
    from tlt_jax.data import load_gsm8k_file

    text = "".join(json.dumps({"question": ex["question"], "answer": f"#### {ex['ground_truth']}", "id": ex["id"]})
                   + "\n" for ex in examples)
    atomic_write(out / name, text.encode())
    f = load_gsm8k_file(out / name, lambda q: q)
    if f.num_skipped:
        raise DataError(f"{out / name}: {f.num_skipped} malformed rows {f.skipped_by_reason}")
    want = [(ex["question"], ex["ground_truth"]) for ex in examples]
    got = [(ex["question"], ex["ground_truth"]) for ex in f.examples]
    if got != want:
        bad = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        raise DataError(f"{out / name}: row {bad} reads back as {got[bad : bad + 1]}, generated {want[bad : bad + 1]}")
    return {"file": name, "rows": len(examples), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def prepare(out_dir: str | os.PathLike, rl_data, decode_size: int | None = None) -> dict:
    """Generate the decoding prompts and the RL data block ``rl_data`` (a DataConfig) into ``out_dir``; the manifest
    is written last, so a folder without one is incomplete. Returns the manifest."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataError(f"preparing the data needs reasoning-gym (pip install reasoning-gym): {e}") from e

    from tlt_jax.data import generated_splits
    from tlt_jax.drafter.warmup import EVAL_SIZE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    plain = lambda q: q  # noqa: E731 - the files keep questions; the run formats them (chat template, instruction)
    size = decode_size or EVAL_SIZE
    dec = generated_splits(DECODE_TASK, 1, size, formatter=plain).eval  # as load_policy_and_prompts(..., "eval")
    manifest = {"format": FORMAT, "reasoning_gym": getattr(reasoning_gym, "__version__", "?"), "rl": None,
                "decode": {"task": DECODE_TASK, "split": "eval", "size": size, **_file(out, "decode.jsonl", dec)}}
    key = rl_key(rl_data)
    if key is not None:
        splits = generated_splits(*(key[k] for k in RL_KEYS[:5]), formatter=plain)
        manifest["rl"] = {**key, "train": _file(out, "train.jsonl", splits.train),
                          "eval": _file(out, "eval.jsonl", splits.eval)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check(data_dir: str | os.PathLike) -> dict:
    """The manifest of ``data_dir``, after checking every file's sha256; a DataError naming the fix otherwise."""
    d = Path(data_dir)
    path = d / MANIFEST
    if not path.is_file():
        what = "does not exist" if not d.exists() else f"has no {MANIFEST} (not prepared, or prepared only partly)"
        raise DataError(f"data folder {d} {what}: {FIX.replace('DIR', str(d))}, then carry it to this machine")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest")
    files = [manifest["decode"]] + ([manifest["rl"]["train"], manifest["rl"]["eval"]] if manifest["rl"] else [])
    for f in files:
        p = d / f["file"]
        if not p.is_file():
            raise DataError(f"{p} is missing: carry {d} again, whole")
        got = hashlib.sha256(p.read_bytes()).hexdigest()
        if got != f["sha256"]:
            raise DataError(f"{p} is corrupt (sha256 {got}, {MANIFEST} says {f['sha256']}): carry {d} again")
    return manifest


def rl_overrides(data_dir: str | os.PathLike, manifest: dict, rl_data) -> dict:
    """Config overrides that make the RL cells read the prepared files instead of generating their data block
    ``rl_data``; a DataError when the folder was prepared for another one."""
    want, have = rl_key(rl_data), manifest["rl"] and {k: manifest["rl"][k] for k in RL_KEYS}
    if want is None:
        return {}
    if want != have:
        diff = "; ".join(f"{k}: {(have or {}).get(k)!r} there, {want[k]!r} here" for k in RL_KEYS
                         if (have or {}).get(k) != want[k])
        raise DataError(f"{data_dir} was prepared for other RL data ({diff}): {FIX.replace('DIR', str(data_dir))}")
    d = Path(data_dir).resolve()
    return {"data.source": "gsm8k_file", "data.train_path": str(d / manifest["rl"]["train"]["file"]),
            "data.eval_path": str(d / manifest["rl"]["eval"]["file"]), "data.instruction": want["instruction"]}


def decode_questions(data_dir: str | os.PathLike, formatter, num_prompts: int) -> list[dict]:
    """The first ``num_prompts`` decoding prompts (``load_gsm8k_file`` examples, formatted by ``formatter``)."""
    from tlt_jax.data import load_gsm8k_file

    manifest = check(data_dir)
    if manifest["decode"]["rows"] < num_prompts:
        raise DataError(f"{data_dir}: {manifest['decode']['rows']} decoding prompts, {num_prompts} needed")
    return load_gsm8k_file(Path(data_dir) / manifest["decode"]["file"], formatter).examples[:num_prompts]


def load_policy_and_prompts(model: str | None, data_dir: str | os.PathLike, num_prompts: int):
    """``tlt_jax.drafter.warmup.load_policy_and_prompts(model, num_prompts, seed, "eval")`` with the prompts read
    from ``data_dir``: (policy, prompt token lists, stop tokens)."""
    from tlt_jax.data import PromptFormatter, instruction_for
    from tlt_jax.models import load_model_and_tokenizer

    if model is None:
        from tlt_jax.models.presets import default_model_path

        model = str(default_model_path())
    policy, tok = load_model_and_tokenizer(model)
    fmt = PromptFormatter(chat_template=tok.apply_chat_template if tok.chat_template else None,
                          instruction=instruction_for(DECODE_TASK))
    examples = decode_questions(data_dir, fmt, num_prompts)
    return policy, [tok.encode(ex["prompt_text"]) for ex in examples], tuple(tok.eos_token_ids) or None
