"""One drafter gradient step with the token loss over whole rows against LM-head chunks (``logit_chunk``).

SmolLM2-135M policy (V = 49152), a fresh EAGLE drafter, the default run's drafter batch (4 rows x 256 positions,
random features). For each arm: the compiled step's temporary bytes (XLA's memory analysis) and the process CPU seconds
and wall seconds of ``--calls`` calls, the arms interleaved call by call; the whole-row arm runs twice (A/A) so its
spread against itself sits beside the ratio.

    python benchmarks/drafter_step.py --calls 6   # -> results/drafter_step_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.drafter import EagleDrafter
from tlt_jax.drafter.train import (
    DrafterBatch,
    DrafterLossConfig,
    init_drafter_train_state,
    make_drafter_optimizer,
    make_drafter_train_step,
)
from tlt_jax.models import load_model_and_tokenizer
from tlt_jax.models.presets import DEFAULT_MODEL

RESULTS = Path(__file__).resolve().parent / "results" / "drafter_step_smollm2_cpu.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=DrafterLossConfig().logit_chunk)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    policy, _ = load_model_and_tokenizer(DEFAULT_MODEL, jnp.float32, jnp.float32)
    drafter = EagleDrafter(policy.config, rngs=nnx.Rngs(0))
    optimizer = make_drafter_optimizer()
    rng = np.random.default_rng(0)
    b, t, h = args.rows, args.positions, policy.config.hidden_size
    batch = DrafterBatch(jnp.asarray(rng.integers(0, policy.config.vocab_size, (b, t)), jnp.int32),
                         jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32),
                         jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32),
                         jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)), jnp.ones((b, t), jnp.int32),
                         jnp.ones((b, t), jnp.float32))
    arms = {"whole": 0, f"chunk{args.chunk}": args.chunk, "whole_again": 0}
    steps, states, temps, losses = {}, {}, {}, {}
    for name, chunk in arms.items():
        graphdef, state = init_drafter_train_state(drafter, optimizer)
        steps[name] = make_drafter_train_step(graphdef, optimizer, DrafterLossConfig(logit_chunk=chunk))
        temps[name] = steps[name].lower(state, policy, batch, jax.random.key(0)).compile() \
            .memory_analysis().temp_size_in_bytes
        states[name], metrics = steps[name](state, policy, batch, jax.random.key(0))  # compile + first step
        losses[name] = float(metrics.loss)
    cpu, wall = {k: [] for k in arms}, {k: [] for k in arms}
    for i in range(args.calls):
        for name in arms:
            c, w = time.process_time(), time.perf_counter()
            states[name], _ = steps[name](states[name], policy, batch, jax.random.key(i + 1))
            jax.block_until_ready(states[name])
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    med = {k: {"cpu_s": statistics.median(cpu[k]), "wall_s": statistics.median(wall[k])} for k in arms}
    chunked = f"chunk{args.chunk}"
    result = {
        "backend": jax.default_backend(), "jax": jax.__version__, "rows": b, "positions": t,
        "vocab": policy.config.vocab_size, "calls": args.calls,
        "temp_bytes": temps, "first_loss": losses, "median": med, "cpu_s": cpu, "wall_s": wall,
        "cpu_ratio_chunked_over_whole": med[chunked]["cpu_s"] / med["whole"]["cpu_s"],
        "cpu_ratio_aa": med["whole_again"]["cpu_s"] / med["whole"]["cpu_s"],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name in arms:
        print(f"{name:>12}: temporaries {temps[name] / 1e9:.2f} GB, CPU {med[name]['cpu_s']:.3f} s, "
              f"wall {med[name]['wall_s']:.3f} s per step, first loss {losses[name]:.6f}")
    print(f"CPU {chunked} / whole {result['cpu_ratio_chunked_over_whole']:.3f}x (A/A {result['cpu_ratio_aa']:.3f}x)"
          f" -> {args.out}")


if __name__ == "__main__":
    main()
