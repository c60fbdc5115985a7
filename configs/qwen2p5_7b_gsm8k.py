"""TLT's 7B GRPO recipe on GSM8K: Qwen2.5-7B from an HF safetensors directory, GSM8K parquet/jsonl, one GPU node.

    python -m tlt_jax.main --config=configs/qwen2p5_7b_gsm8k.py \
        --config.model.path=/path/to/Qwen2.5-7B \
        --config.data.train_path=/path/to/gsm8k/train.parquet \
        --config.data.eval_path=/path/to/gsm8k/test.parquet \
        --workdir=runs/qwen2p5_7b_gsm8k

TLT defaults (examples/grpo_7B.sh; configs/base.py ``tlt_grpo``): 64 prompts x 8 samples = 512 responses per step,
temperature 0.9, top-p 1, lr 1e-6 constant, weight decay 0.01, grad clip 1.0, KL loss 0.001 low-var k3, clip 0.2,
token-mean, 1 epoch, mini-batches of 4 prompts (16 updates per step). Response cap 2,048 tokens (GSM8K answers are
short; TLT's 32K cap is for Eurus math/code). bf16 compute, float32 parameters and AdamW state, rematerialised
layers, parameters FSDP-sharded over all devices; rollouts decode a bf16 copy split over mesh.tensor only (no weight
gathers). Evaluation: greedy on the first 512 test problems. Memory plan: ``python -m tlt_jax.plan`` (the commands in
benchmarks/results/plan_qwen7b_*dev.json).
Expected: an 8 x H100 node; hours for the 116 steps of one GSM8K epoch (rollout dominates; not run in this
repository's CI - the CPU job is configs/gsm8k.py). Reading .parquet needs pyarrow (pip install pyarrow).
"""

from tlt_jax.config import config_file

base = config_file(__file__, "base")


def get_config():
    c = base.tlt_grpo(base.get_config())
    c.name = "qwen2p5_7b_gsm8k"
    c.model.source = "path"
    c.model.path = ""  # required: --config.model.path=/path/to/Qwen2.5-7B
    c.model.dtype = "bfloat16"
    c.model.remat = True
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.data.source = "gsm8k_file"
    c.data.train_path = ""  # required: --config.data.train_path=.../train.parquet
    c.data.eval_path = ""
    c.data.eval_size = 512
    c.data.prompts_per_step = 64
    c.data.max_prompt_len = 1024
    c.rollout.max_new_tokens = 2048
    c.rollout.dtype = "bfloat16"  # the decode copy: bf16 weights split over mesh.tensor only, resharded once per step
    c.rl.mini_batch_prompts = 4
    c.rl.micro_batch_size = 8
    c.reward.num_workers = 8
    c.eval.batch_size = 256
    c.checkpoint.every_steps = 30
    c.checkpoint.max_to_keep = 3
    c.train.num_steps = 116
    return c
