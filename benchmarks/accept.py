"""Accept length (tokens emitted per verify step and row, bonus token included) at the RL temperatures, no timing:
deterministic given the seeds. Issue 60's measure of every drafter.

    python benchmarks/accept.py [--tasks=arithmetic,gsm_symbolic] [--prompts=2] [--n=8] [--temps=0.9]
        [--arms=eagle:8x4x48,eagle:5x1x6,ngram:6x3x16,history:6x3x16] [--drafters=eagle,ngram,history]
        [--max_new_tokens=128] [--out=benchmarks/results/accept_smollm2_cpu.json]

Prompts: held-out problems of the main job's generated sources, chat-templated; a GRPO group of --n samples per
prompt, a task's prompts in one ``generate`` call, speculating from the first step. Drafters: "eagle" (--drafter),
"ngram" and "history" (the n-gram drafter with the store of earlier calls' responses: seed --seed fills it, seed
--seed + 1 decodes with it, against a "control" without it whose tokens must match; ``epoch2_ratio``: accept over the
first epoch's). --arms: "DxKxN" crossed with --drafters, or "DRAFTER:DxKxN". Output: ``args``, ``meta``, ``table``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, flags

from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

DRAFTERS = ("eagle", "ngram", "history")
TASKS = ("arithmetic", "gsm_symbolic")

flags.DEFINE_string("model", None, "policy GGUF / directory; default: the embedded SmolLM2-135M-Instruct")
flags.DEFINE_string("drafter", EMBEDDED_DRAFTER, "EAGLE drafter directory or shipped drafter name")
flags.DEFINE_list("tasks", list(TASKS), f"prompt sources, of {TASKS}")
flags.DEFINE_integer("prompts", 2, "held-out prompts per task (one GRPO group each)")
flags.DEFINE_integer("n", 8, "samples per prompt (GRPO group)")
flags.DEFINE_list("temps", ["0.9"], "sampling temperatures (0 = greedy)")
flags.DEFINE_list("arms", ["eagle:8x4x48", "eagle:5x1x6", "ngram:6x3x16", "history:6x3x16"],
                  "tree shapes DxKxN (crossed with --drafters) or DRAFTER:DxKxN")
flags.DEFINE_list("drafters", list(DRAFTERS), f"drafters to run, of {DRAFTERS}")
flags.DEFINE_integer("max_new_tokens", 128, "most new tokens per sample")
flags.DEFINE_integer("seed", 0, "sampling seed (history: the first epoch's; the second epoch uses seed + 1)")
flags.DEFINE_integer("history_bytes", 64 * 2**20, "the history drafter's store (ngram_history_bytes)")
flags.DEFINE_string("out", "benchmarks/results/accept_smollm2_cpu.json", "result JSON")
_F = flags.FLAGS


def cells(arms: list[str], drafters: list[str]) -> list[tuple[str, str]]:
    """(drafter, DxKxN) cells of --arms, filtered by --drafters, in order, without repeats."""
    out = []
    for a in arms:
        name, _, shape = a.rpartition(":")
        for d in [name] if name else drafters:
            if d not in DRAFTERS:
                raise app.UsageError(f"--arms {a!r}: drafter {d!r} is not one of {DRAFTERS}")
            if len(shape.split("x")) != 3:
                raise app.UsageError(f"--arms {a!r}: expected DxKxN, e.g. 8x4x48")
            if d in drafters and (d, shape) not in out:
                out.append((d, shape))
    return out


def load_prompts(tok, task: str, num: int) -> list[list[int]]:
    """``num`` held-out prompts of a generated source, formatted as the main job formats them."""
    from tlt_jax.data.prompts import PromptFormatter, instruction_for
    from tlt_jax.data.sources import generated_splits

    fmt = PromptFormatter(chat_template=tok.apply_chat_template if tok.chat_template else None,
                          instruction=instruction_for(task))
    examples = generated_splits(task, 1, num, formatter=fmt).eval
    return [tok.encode(ex["prompt_text"]) for ex in examples]


def engine_for(policy, drafter, name: str, shape: str, max_batch: int, max_len: int) -> RolloutEngine:
    """A fixed-arm engine speculating from the first step; one length bucket and batch buckets in steps of 4 (fewer
    compiles; accept lengths do not depend on them)."""
    depth, topk, nodes = (int(x) for x in shape.split("x"))
    spec = SpecConfig(depth=depth, topk=topk, verify_tokens=nodes, threshold=max_batch)
    buckets = tuple(b for b in (256, 64, 16, 4, 1) if b <= max_batch)
    return RolloutEngine(policy, drafter=drafter if name == "eagle" else "ngram", spec=spec, max_batch=max_batch,
                         max_len=max_len, length_buckets=(max_len,), batch_buckets=(max_batch, *buckets),
                         ngram_history_bytes=_F.history_bytes if name == "history" else 0)


def _accept(res) -> dict:
    st = res.stats
    return dict(accept=st["mean_accept_length"], row_verifies=st["spec"]["row_verifies"],
                tokens=int(sum(len(t) for g in res.tokens for t in g)))


def run_cell(engine: RolloutEngine, name: str, prompts, temp: float, stops) -> dict:
    """One (drafter, arm, T, task) cell: the accept length of one call (history: of the second epoch, with the
    first epoch and the control beside it)."""
    params = lambda seed: SamplingParams(temperature=temp, n=_F.n, max_new_tokens=_F.max_new_tokens,  # noqa: E731
                                         seed=seed, stop_token_ids=stops)
    if name != "history":
        return _accept(engine.generate(prompts, params(_F.seed)))
    store, engine.ngram_history = engine.ngram_history, None
    control = engine.generate(prompts, params(_F.seed + 1))  # no store: the n-gram drafter at the second seed
    engine.ngram_history = store
    store.clear()
    first = engine.generate(prompts, params(_F.seed))  # the first epoch fills the store
    second = engine.generate(prompts, params(_F.seed + 1))
    row = _accept(second)
    row.update(epoch1=_accept(first)["accept"], control=_accept(control)["accept"], epoch1_stats=_accept(first),
               epoch2_ratio=row["accept"] / max(_accept(first)["accept"], 1e-9),
               epoch2_over_control=row["accept"] / max(_accept(control)["accept"], 1e-9),
               lossless=second.tokens == control.tokens, history_bytes=store.nbytes, history_entries=len(store))
    store.clear()
    return row


def main(argv):
    del argv
    from tlt_jax.drafter.export import load_drafter
    from tlt_jax.models import load_model_and_tokenizer

    t0 = time.perf_counter()
    todo = cells(_F.arms, _F.drafters)
    if not todo:
        raise app.UsageError("no cells: --arms and --drafters select nothing")
    model = _F.model
    if model is None:
        from tlt_jax.models.presets import default_model_path

        model = str(default_model_path())
    policy, tok = load_model_and_tokenizer(model)
    stops = tuple(tok.eos_token_ids) or None
    prompts = {task: load_prompts(tok, task, _F.prompts) for task in _F.tasks}
    drafter = load_drafter(resolve_drafter_path(_F.drafter)) if any(d == "eagle" for d, _ in todo) else None
    max_batch = _F.prompts * _F.n
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_len = -(-(longest + _F.max_new_tokens + 1) // 64) * 64
    table = []
    for name, shape in todo:
        if name == "ngram" and ("history", shape) in todo:
            continue  # the history cell's first epoch is this cell's call (an empty store drafts nothing extra)
        engine = engine_for(policy, drafter, name, shape, max_batch, max_len)
        for temp in (float(t) for t in _F.temps):
            for task, ps in prompts.items():
                row = dict(drafter=name, arm=shape, temperature=temp, task=task, **run_cell(engine, name, ps, temp,
                                                                                            stops))
                if name == "history" and ("ngram", shape) in todo:
                    table.append(dict(row, drafter="ngram", **row["epoch1_stats"], from_history_epoch1=True))
                    for k in ("epoch1", "control", "epoch2_ratio", "epoch2_over_control", "lossless", "history_bytes",
                              "history_entries", "epoch1_stats"):
                        table[-1].pop(k)
                table.append(row)
                extra = (f" (epoch 1 {row['epoch1']:.2f}, x{row['epoch2_ratio']:.2f}; control {row['control']:.2f};"
                         f" lossless {row['lossless']})" if name == "history" else "")
                print(f"{name:>7} {shape:>7} T={temp} {task:>12}: accept {row['accept']:.2f}{extra}", flush=True)
                write(table, model, t0, final=False)
        engine.close()
    write(table, model, t0, final=True)


def write(table: list[dict], model: str, t0: float, final: bool) -> None:
    """The result JSON: ``args`` (every flag of this script), ``meta`` and ``table``; partial while running."""
    args = {k: getattr(_F, k) for k in ("model", "drafter", "tasks", "prompts", "n", "temps", "arms", "drafters",
                                        "max_new_tokens", "seed", "history_bytes", "out")}
    meta = dict(model=model, device=str(jax.devices()[0]), jax=jax.__version__, dtype="float32",
                machine=f"{platform.machine()}, {os.cpu_count()} cores (shared)", complete=final,
                total_seconds=time.perf_counter() - t0, load_average_end=os.getloadavg())
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=args, meta=meta, table=table), indent=1, default=_np))
    if final:
        print(f"wrote {out} in {meta['total_seconds']:.0f}s")


def _np(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    app.run(main)
