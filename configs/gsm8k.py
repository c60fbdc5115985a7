"""The main job, CPU-sized: GRPO on SmolLM2-135M-Instruct (embedded GGUF) with GSM-style problems.

    python -m tlt_jax.main --config=configs/gsm8k.py --workdir=runs/gsm8k

Training prompts: reasoning-gym ``gsm_symbolic`` (seeds from 0); evaluation: held-out ``gsm_symbolic`` problems from
a disjoint seed range (seeds from 1,000,000, questions also de-duplicated against training). TLT's GRPO recipe
(configs/base.py ``tlt_grpo``: temperature 0.9, KL 0.001 low-var k3, clip 0.2, token-mean, grad clip 1.0) at CPU
scale: 2 prompts x 4 samples per step, 128 new tokens, 8 steps, lr 5e-6 (1e-6 moves a 135M model too little in 8
steps to show anything). Measured on the 2-core CPU dev box (one CPU device, ~10 GB RSS): 10 min wall in all with the
machine otherwise lightly used (steps of 60-80 s: rollout ~22 s, log-probs ~12 s, update ~30 s; the final greedy
evaluation of 32 problems ~1 min); 22 min for 10 steps with the cores shared by other jobs (load average 5). Evaluation
accuracy on the 32 held-out problems: 0.03 (a 135M model and 8 CPU steps cannot teach GSM arithmetic, and most
groups score all-zero, so there is rarely any advantage to learn from: the run shows the machinery, not a result).
On a GPU, scale up with e.g. --config.data.prompts_per_step=64 --config.rollout.samples_per_prompt=8.
"""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location("tlt_jax_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config():
    c = base.tlt_grpo(base.get_config())
    c.name = "gsm8k"
    c.model.source = "smollm2"
    c.data.source = "gsm_symbolic"
    c.data.train_size = 2000
    c.data.eval_size = 32
    c.data.prompts_per_step = 2
    c.data.max_prompt_len = 320
    c.data.chat_template = True
    c.rollout.samples_per_prompt = 4
    c.rollout.max_new_tokens = 128
    c.rl.micro_batch_size = 4
    c.optim.lr = 5e-6
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 4
    c.train.num_steps = 8
    return c
