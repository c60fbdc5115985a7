"""The tiny task: a random 2-layer model learns to answer every prompt with a target token. CPU, under a minute.

    python -m tlt_jax.main --config=configs/tiny.py --workdir=runs/tiny

Reward = fraction of the 16 generated tokens equal to token 5 (synthetic prompts of 8 random tokens; a random
model starts near 1/64). Expected on a 2-core CPU: ~30-50 s in all (mostly compiles), mean reward rising from ~0.02
to > 0.5 within 20 steps, final greedy evaluation accuracy (every token = 5) near 1.0. Used by the tests
(resume, NaN handling, learning).
"""

from tlt_jax.config import config_file

base = config_file(__file__, "base")


def get_config():
    c = base.get_config()
    c.name = "tiny"
    c.model.source = "tiny"
    c.model.tiny.vocab_size = 64
    c.data.source = "synthetic"
    c.data.prompts_per_step = 8
    c.data.eval_size = 32
    c.data.synthetic.num_prompts = 256
    c.data.synthetic.prompt_len = 8
    c.data.synthetic.target_token = 5
    c.rollout.samples_per_prompt = 4
    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens = 16
    c.rl.kl_coef = 0.001
    c.rl.micro_batch_size = 16
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 2
    c.eval.at_start = True
    c.checkpoint.every_steps = 2
    c.train.num_steps = 20
    return c
