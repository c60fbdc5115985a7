"""The main job, CPU-sized: GRPO on SmolLM2-135M-Instruct (embedded GGUF) with TLT's adaptive rollout and drafter.

    python -m tlt_jax.main --config=configs/gsm8k.py --workdir=runs/gsm8k

Task: small additions (reasoning-gym ``basic_arithmetic``, a + b with 1-2 digit operands, disjoint train / held-out
seeds), asked to think step by step and end with "The answer is N."; the reward is exact-match correctness, so the
"reward" and "acc" columns agree (``--config.reward.format_weight=0.5`` adds a format reward: in the same 12 steps
here it drew the policy to the format, not the sums: held-out accuracy 0.375 -> 0.531 -> 0.438 -> 0.344).
Responses end by themselves: most within a few dozen tokens, a few at the 256 cap.

Rollout: TLT's adaptive engine. A bandit per batch bucket picks plain decoding or an EAGLE tree from measured
tokens/s (``rollout.spec_arms``), exploring only while its ledger's loss against plain decoding stays under 5 % of
plain's time (``rollout.spec_max_loss``), starting from the warmed-up drafter shipped with the package
(``rollout.drafter_path="eagle-smollm2-gsm"``), and that drafter trains online on the policy's own responses
(``drafter.online``: on one CPU device no slice is ever idle, so ``drafter.steps_without_idle`` steps run after each
rollout, shown in the "draft s" column). GRPO as in configs/base.py ``tlt_grpo`` (clip 0.2, token-mean, grad clip 1.0)
without the KL term (no reference pass, as Dr. GRPO / DAPO; TLT's recipe uses 0.001), temperature 0.7 and a learning
rate a 135M model moves with in a few steps. On a GPU, scale up with e.g. --config.data.prompts_per_step=64
--config.rollout.samples_per_prompt=8.

Measured (2026-11-26, fresh clone and venv on the 2-core x86 CPU VM, README's command, with coupled drafting for
sampled rows; 10 min 2 s wall including the install, 549 s for the job itself; steps of 16-59 s, median 33 s, of
which the policy update ~20 s; the two runs before that change took 8 min 45 s and 8 min 0 s on the same machine,
whose speed drifts by tens of percent):
- held-out greedy accuracy (32 prompts): 0.375 at step 0, 0.625 at step 4, 0.688 at step 8, 0.656 at the end;
- training reward (8 samples per step at T = 0.7, noisy): mean 0.21 over steps 1-6, 0.31 over steps 7-12;
- response lengths: median 30-94 tokens per step, longest 54-256 (the cap, steps 8 and 12);
- accept length 1.50-2.68 tokens per verify in the rollouts; the bandit ran an EAGLE arm for 4-71 % of the chunks;
  4 drafter steps per RL step (drafter loss 0.45 -> 0.41); on the held-out prompts (eval/accept_length, greedy)
  2.14 at step 0 and 2.21-2.56 later. The samples, accuracies, rewards and drafter losses are the same in every
  fresh run (speculation never changes them); the accept lengths are not, because the bandit's choice of arm follows
  the machine's timings: the two runs before coupled drafting gave 1.33-2.71 and 1.33-2.42 in the rollouts, and a
  run at the final version of coupled drafting (9 min 12 s, median step 28 s) 1.73-2.67 (no EAGLE chunk in step 3),
  2.14-2.71 held out; another on 2026-11-26 (7 min 45 s, median step 27 s) 1.75-2.75 in the rollouts (none in step
  3), held out 2.14, 2.20 and 3.17 (steps 0, 4, 12); with new verify steps compiled in the background (2026-11-27,
  8 min 54 s including the install) 1.81-2.97 in the rollouts, and 26.7 s of background compiles, all in steps 1-3;
  with that compile thread at nice 19 (2026-11-27, 9 min 22 s including the install) 1.74-2.52 (none in step 7),
  and 67 s of background compiles (wall time at low priority) in steps 1-4, 8 and 9 (step 8 held the first
  256-token responses and an evaluation, both new shapes).
  Adaptive against plain rollouts on this CPU:
  over 12 steps with the drafter frozen, repeated twice with the order alternating, 0.90x and 0.91x plain's speed
  when the extra arms' programs compiled in place, 0.97x and 0.96x without those compiles; since new verify steps
  compile in the background, 0.97x over four such repeats (0.92x-1.06x per pair), and 0.96x over six (0.74x-1.11x)
  with the compile thread at the lowest CPU priority (benchmarks/README.md, "Adaptive vs off on the default run");
  with every rollout decoded both ways back to back in one run (``e2e_step.py --paired adaptive``), 0.91x over
  33 steps of three runs (90 % bootstrap interval 0.84x-0.97x; runs 0.91x, 0.98x, 0.84x; an A/A run 1.00x), most
  of the loss in round trips beside background compiles; the first paired runs' 1.03x and 1.01x were biased by an
  asynchronous checkpoint write beside the "off" engine's rollouts of steps 5 and 9 (0.95x without those steps)
  (benchmarks/README.md, "Adaptive vs off on the default run, paired, without the checkpoint bias"); with the loss
  budget, 0.94x over 33 paired steps of three runs with the drafter frozen (0.90x-0.98x; runs 0.87x, 0.97x, 0.99x) and
  1.03x and 0.84x in two runs of this config as it is (drafter trained online); 0.93x over all 55 steps (0.89x-0.98x),
  the adaptive engine decoding plainly on 96-99 % of its steps once steps 1-2's EAGLE tries and compiles had spent the
  budget ("..., paired, with a loss budget"). The README's command with the budget (2026-11-27, fresh clone, 8 min 17
  s including the install): held-out accuracy 0.375, 0.625, 0.688, 0.656; EAGLE arms on 6-100 % of each step's decode
  steps, and the bandit's ledger reporting 23-34 % of plain's estimated decode seconds saved from step 2 on
  (``rollout/spec_loss``; an estimate, not a paired measurement: in the paired runs of this config the first steps
  measured a loss instead and the bandit held to plain decoding). With XLA's compile threads niced and safe tries
  (2026-11-27, fresh clone, 8 min 0 s including the install): the same accuracies; the ledger at an 8.6 % loss
  after step 2 (a cold compilation cache), EAGLE arms on 3-20 % of the decode steps of steps 1-3 and 8 and plain
  decoding otherwise; paired, 0.92x over 44 steps of four runs (0.87x-0.98x; "..., with XLA's compile threads niced
  and safe tries"). With new speculative steps compiled between rollouts instead of beside them: paired, 1.00x over
  33 steps of three runs (0.94x-1.06x; runs 0.94x, 1.03x, 1.03x; "..., paired, with compiles between rollouts").
  The README's command with that change (2026-11-27, fresh clone, 8 min 25 s including the install): the same
  accuracies; EAGLE arms on 3-22 % of the decode steps of steps 2-5, 7 and 10-12, plain decoding otherwise; the
  ledger's loss at most 6.0 % (step 7) and 2.9 % at the end.
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
    c.rl.micro_batch_size = 4
    c.optim.lr = 2e-5
    c.rl.kl_coef = 0.0  # no reference forward pass (as Dr. GRPO / DAPO); TLT's recipe uses 0.001
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 4
    c.train.num_steps = 12
    c.eval.at_start = True
    c.eval.every_steps = 4
    return c
