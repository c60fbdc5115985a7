"""The main job, CPU-sized: GRPO on SmolLM2-135M-Instruct (embedded GGUF) with TLT's adaptive rollout and drafter.

    python -m tlt_jax.main --config=configs/gsm8k.py --workdir=runs/gsm8k

Task: small additions (reasoning-gym ``basic_arithmetic``, a + b with 1-2 digit operands, disjoint train / held-out
seeds), asked to think step by step and end with "The answer is N."; the reward is exact-match correctness, so the
"reward" and "acc" columns agree (``--config.reward.format_weight=0.5`` adds a format reward for "The answer is N."
statements; accuracy stays exact match). Responses end by themselves: most within a few dozen tokens, a few at the
256 cap.

Rollout: TLT's adaptive engine. A bandit per batch bucket picks plain decoding or an EAGLE tree from measured
tokens/s (``rollout.spec_arms``), exploring only while its ledger's loss against plain decoding stays under 5 % of
plain's time (``rollout.spec_max_loss``), starting from the warmed-up drafter shipped with the package
(``rollout.drafter_path="eagle-smollm2-gsm"``), and that drafter trains online on the policy's own responses
(``drafter.online``: on one CPU device no slice is ever idle, so ``drafter.steps_without_idle`` steps, 4 by default,
run after each rollout, shown in the "draft s" and "crit s" columns). GRPO as in configs/base.py ``tlt_grpo`` (clip
0.2, token-mean, grad clip 1.0) without the KL term (no reference pass, as Dr. GRPO / DAPO; TLT's recipe uses 0.001),
temperature 0.7 and a learning rate a 135M model moves with in a few steps. On a GPU, scale up with e.g.
--config.data.prompts_per_step=64 --config.rollout.samples_per_prompt=8.

Measured (2026-11-28, fresh clone and venv on the 2-core x86 CPU VM, README's command with stdout redirected to a
file: 9 min 32 s including the install, 521 s for the job; console log and metrics in
benchmarks/results/default_run_gsm8k.log and default_run_gsm8k_metrics.jsonl):
- held-out greedy accuracy (32 prompts): 0.375 at step 0, 0.625 at step 4, 0.688 at step 8, 0.656 at the end
  (these do not depend on the machine: speculation never changes the samples);
- training reward (8 samples per step at T = 0.7, noisy): 0.00-0.50 per step;
- response lengths: median 30-94 tokens per step, longest 54-256 (the cap, steps 8 and 12);
- the bandit ran an EAGLE arm on 2-9 % of the decode steps of steps 2, 5 and 9 (accept length 2.0-4.0 there) and
  plain decoding otherwise; its ledger's loss against plain decoding ended at 5.4 % (``rollout/spec_loss``);
- 4 drafter steps per RL step (drafter loss 0.45 -> 0.41); held-out accept length 2.38 at step 8, 3.94 at the end.
The accept lengths and arm shares follow the machine's timings (the bandit measures tokens/s), so they differ from
run to run. Adaptive against plain rollouts, paired on this CPU: benchmarks/README.md, "End-to-end RL step".
Plots in workdir/plots (reward and held-out accuracy, response lengths, accept length, the drafter timeline).
"""

from tlt_jax.config import config_file

base = config_file(__file__, "base")


def get_config():
    c = base.tlt_grpo(base.get_config())
    c.name = "gsm8k"
    c.model.source = "smollm2"
    c.data.source = "arithmetic"
    c.data.train_size = 1000
    c.data.eval_size = 32
    c.data.prompts_per_step = 2
    c.data.max_prompt_len = 320
    c.data.chat_template = True
    c.rollout.samples_per_prompt = 4
    c.rollout.temperature = 0.7
    c.rollout.max_new_tokens = 256
    c.rollout.speculative = "adaptive"
    c.rollout.spec_arms = "off,eagle:3x1x4,eagle:5x1x6"
    c.rollout.drafter_path = "eagle-smollm2-gsm"
    c.drafter.online = True
    c.drafter.window = 256  # whole responses (up to max_new_tokens) go to the drafter's data buffer
    c.drafter.rows = 4
    c.drafter.row_len = 256
    # Two rows per micro-batch: the update's temporaries were 0.79 GB, 1.05 GB with four; since the optimizer update
    # is one pass (its new trees wait for the finite check) they are 1.75 GB either way (python -m tlt_jax.plan
    # --config=configs/gsm8k.py --devices=1 --backend=cpu [--config.rl.micro_batch_size=4]), the run's peak memory.
    c.rl.micro_batch_size = 2
    # Recompute each decoder layer in the backward pass (the run's peak memory, issue 42): the update's saved
    # attention probabilities [layers, 4, 9, T, T] and MLP intermediates set the peak when a response reaches the
    # 256-token cap (T = 512).
    c.model.remat = True
    c.optim.lr = 2e-5
    c.rl.kl_coef = 0.0  # no reference forward pass (as Dr. GRPO / DAPO); TLT's recipe uses 0.001
    # Held-out prompts decoded 16 at a time: a batch of 32 holds a 0.94 GB KV cache at the 640-token bucket (30 layers
    # x keys and values x 32 x 640 x 3 heads x 64 float32), which set the run's peak memory in the final evaluation
    # (issue 42). The evaluations take longer: 117 s against 95 s over the run's four
    # (benchmarks/results/default_run_gsm8k_peak_rss.json).
    c.eval.batch_size = 16
    c.checkpoint.every_steps = 4
    c.train.num_steps = 12
    c.eval.at_start = True
    c.eval.every_steps = 4
    return c
