"""TLT's 32B recipe on GSM8K: Qwen2.5-32B on 8 nodes x 8 H100s, one tensor-parallel-8 rollout engine per node,
adaptive speculation and the online drafter (TLT, examples/grpo_32B_multi_nodes.sh).

    python -m tlt_jax.drafter.warmup --model=/path/to/Qwen2.5-32B --out=/path/to/eagle-qwen32b \
        --num_prompts=512 --max_new_tokens=512 --temperatures=0,0.9 --draft_vocab=32768 --steps=2000
    RECIPE=32b MODEL=/path/to/Qwen2.5-32B DATA=/path/to/gsm8k sbatch --nodes=8 launch/slurm/train.sbatch \
        --config.rollout.drafter_path=/path/to/eagle-qwen32b

(the command the script runs on each node: ``python -m tlt_jax.main --config=configs/qwen2p5_32b_gsm8k.py
--config.model.path=$MODEL --config.data.train_path=$DATA/train.parquet --config.data.eval_path=$DATA/test.parquet
--workdir=...``). Without ``rollout.drafter_path`` the run starts from a fresh drafter that only online training
teaches.

Layout: mesh (data, fsdp, tensor) = (1, -1, 8), i.e. 1 x 8 x 8 on 64 GPUs. ``tensor`` = a node's 8 GPUs (TLT's
TP 8), so the engines (``rollout.num_slices = -1``: one per TP group) are the 8 nodes, each decoding 256 of the
step's 2,048 responses with no collective outside its node. ``make_mesh`` orders the devices by node: TP groups
never span nodes, and FSDP runs over the 8 nodes' matching GPUs. HSDP proper (FSDP inside a node) would be fsdp 1
here, i.e. the whole float32 train state of a TP-8 shard on every GPU (32.8 B parameters x 12 bytes of parameter
and AdamW moments / 8 = 49 GB); ``--config.mesh.data=2 --config.mesh.fsdp=4`` is the hybrid between (FSDP over
groups of 4 nodes, data-parallel across the 2 groups: twice the train state per GPU of this layout). The log-prob
passes all-gather 1.8 x the bf16 model per GPU (8 chunks of 256 rows; ``steps.logprobs`` of
benchmarks/results/plan_qwen2p5_32b_h100_8x8.json).

Everything else as configs/qwen2p5_7b_gsm8k.py (``tlt_rollout``: speculation at <= 32 live rows over TLT's arms,
drafter trained on finished engines, bfloat16 TP copy for the engines, the tree-attention kernel), with TLT's 32B
batch: 256 prompts x 8 = 2,048 responses per step, mini-batches of 8 prompts (32 updates per step). Prompts up to 512
tokens (GSM8K's are short; TLT's 2,048 is for Eurus), responses up to 2,048. Memory plan: ``python -m tlt_jax.plan
--config=configs/qwen2p5_32b_gsm8k.py --shape=qwen2.5-32b --target=h100:8x8``. Not run in this repository's CI.
"""

from tlt_jax.config import config_file

recipe_7b = config_file(__file__, "qwen2p5_7b_gsm8k")


def get_config():
    c = recipe_7b.get_config()
    c.name = "qwen2p5_32b_gsm8k"
    c.model.path = ""  # required: --config.model.path=/path/to/Qwen2.5-32B
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 8
    c.data.prompts_per_step = 256
    c.data.max_prompt_len = 512
    c.rl.mini_batch_prompts = 8
    c.rl.micro_batch_size = 8
    c.reward.num_workers = 16
    c.train.num_steps = 29  # one GSM8K epoch (7,473 problems / 256)
    # SLURM's stop ahead of the time limit (launch/slurm/train.sbatch) must outlast a step and a save: ByteDance's 32B
    # trace in TLT's paper took about 40 min a step on 128 GPUs; check time/step_s in metrics.jsonl.
    c.checkpoint.stop_lead_s = 3600
    return c
