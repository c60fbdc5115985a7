"""What coupled drafting adds to an EAGLE draft step: ``coupled_scores`` for one tree depth (the verifier's Gumbel
vector over the full vocabulary, gathered to the draft vocabulary, plus the temperature-scaled log-softmax), timed
alone by batch at the committed SmolLM2 drafter's shapes (vocabulary 49,152, its draft vocabulary, topk 1). Greedy
batches pay the same: the scores do not branch on the batch's temperatures.

    python benchmarks/coupling_cost.py [--batches=1,4,16] [--out=benchmarks/results/coupling_cost_smollm2_cpu.json]
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.drafter.export import VOCAB_FILE
from tlt_jax.speculative.tree import DraftSampling, coupled_scores
from tlt_jax.speculative.verify import depth_keys

_F = flags.FLAGS
flags.DEFINE_list("batches", ["1", "4", "16"], "rows drafting at once")
flags.DEFINE_integer("reps", 50, "timed calls per batch (median reported)")
flags.DEFINE_string("out", "benchmarks/results/coupling_cost_smollm2_cpu.json", "JSON output")

VOCAB = 49152  # SmolLM2-135M


def main(argv):
    del argv
    ids = jnp.asarray(np.load(pathlib.Path(resolve_drafter_path(EMBEDDED_DRAFTER)) / VOCAB_FILE), jnp.int32)
    scores = jax.jit(lambda lg, s: coupled_scores(lg, s, 1, VOCAB, ids))
    rows = []
    for b in (int(x) for x in _F.batches):
        logits = jax.random.normal(jax.random.key(0), (b, 1, ids.shape[0]))
        keys = depth_keys(jnp.zeros((b, 1), jnp.int32), jnp.arange(b), jnp.zeros(b, jnp.int32), jnp.full(b, 100), 3)
        sampling = DraftSampling(keys, jnp.full(b, 0.9))
        scores(logits, sampling).block_until_ready()  # compile
        times = []
        for _ in range(_F.reps):
            t = time.perf_counter()
            scores(logits, sampling).block_until_ready()
            times.append(time.perf_counter() - t)
        rows.append(dict(batch=b, ms_per_depth=1000 * float(np.median(times))))
        print(f"batch {b}: {rows[-1]['ms_per_depth']:.3f} ms per tree depth", flush=True)
    meta = dict(vocab=VOCAB, draft_vocab=int(ids.shape[0]), temperature=0.9, device=str(jax.devices()[0]),
                machine=f"{platform.machine()}, {os.cpu_count()} cores (shared)", jax=jax.__version__)
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    app.run(main)
