"""Shared defaults of every run: the dataclass defaults of ``tlt_jax.config`` as a ConfigDict.

    python -m tlt_jax.main --config=configs/base.py --workdir=runs/base

Other configs start from ``get_config()`` (``base = config_file(__file__, "base")``) and override only what
differs. Run by itself it trains the tiny synthetic task (random tiny model, like configs/tiny.py) with VeRL's
conservative GRPO defaults (lr 1e-6, KL 0.001 low-var k3, clip 0.2, token-mean): it finishes in well under a minute
on CPU and barely learns at that learning rate.

Blocks (see tlt_jax/config.py and tlt_jax/rollout_config.py for every field and its checks):
  model       source tiny | smollm2 | path; path; dtype; remat; tiny.* (random model shape)
  mesh        data / fsdp / tensor (-1 = the remaining devices)
  data        source synthetic | gsm_symbolic | arithmetic | gsm8k_file; prompts_per_step; sizes, seeds, paths,
              max_prompt_len, chat_template, instruction; synthetic.*
  rollout     samples_per_prompt (GRPO n), temperature, top_k / top_p (off: RL rejects them), max_new_tokens,
              speculative (off | ngram | eagle | adaptive), drafter_path, spec_threshold / spec_depth / spec_topk /
              spec_verify_tokens (the fixed tree), spec_arms / spec_epsilon / spec_window / spec_patience /
              spec_max_loss (the adaptive bandit), dtype, attention_impl, layers, num_slices
  drafter     online, lr, buffer_bytes, window, steps_without_idle, rows, row_len, prompt_context, hot_swap
  rl          advantage, policy_loss, clip_low/high, loss_agg_mode, kl_coef, kl_kind, mini_batch_prompts, epochs,
              micro_batch_size (the update's), logprob_chunk_rows / logprob_max_gb (the old / reference log-prob
              passes' chunks: 0 = auto, the largest chunk whose estimated temporaries fit logprob_max_gb per device)
  optim       lr, warmup_steps, schedule, final_lr_ratio, weight_decay, b1, b2, eps, max_grad_norm
  reward      num_workers, timeout_s (GSM8K scoring processes), format_weight
  eval        every_steps, at_start, max_new_tokens, batch_size
  checkpoint  every_steps, every_minutes, stop_lead_s (SLURM's stop before the time limit), max_to_keep, async_save
  metrics     progress_bars, tensorboard
  train       num_steps, seed, max_nonfinite_steps, debug_nan_steps, plan_check (start-up memory plan),
              device_memory_gb

Shared blocks: ``tlt_grpo(c)`` sets TLT's GRPO hyper-parameters.
"""

from tlt_jax.config import to_config_dict


def get_config():
    return to_config_dict()


def tlt_grpo(c):
    """TLT's GRPO recipe (examples/grpo_7B.sh): n = 8, temperature 0.9, top-p 1, lr 1e-6 constant, weight decay
    0.01, grad clip 1.0, KL loss 0.001 low-var k3, clip ratio 0.2 / 0.2, token-mean aggregation, 1 PPO epoch."""
    c.rollout.samples_per_prompt = 8
    c.rollout.temperature = 0.9
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.01
    c.optim.max_grad_norm = 1.0
    c.rl.advantage = "grpo"
    c.rl.kl_coef = 0.001
    c.rl.kl_kind = "low_var_kl"
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.2
    c.rl.loss_agg_mode = "token-mean"
    c.rl.epochs = 1
    return c
