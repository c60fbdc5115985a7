"""TLT's 7B recipe on GSM8K: Qwen2.5-7B, one 8 x H100 node, two tensor-parallel-4 rollout engines, adaptive
speculation and the online drafter trained on engines that finished (TLT, examples/grpo_7B.sh).

    python -m tlt_jax.drafter.warmup --model=/path/to/Qwen2.5-7B --out=/path/to/eagle-qwen7b \
        --num_prompts=512 --max_new_tokens=512 --temperatures=0,0.9 --draft_vocab=32768 --steps=2000
    python -m tlt_jax.main --config=configs/qwen2p5_7b_gsm8k.py \
        --config.model.path=/path/to/Qwen2.5-7B \
        --config.rollout.drafter_path=/path/to/eagle-qwen7b \
        --config.data.train_path=/path/to/gsm8k/train.parquet \
        --config.data.eval_path=/path/to/gsm8k/test.parquet \
        --workdir=runs/qwen2p5_7b_gsm8k

or on SLURM, ``MODEL=... DATA=... sbatch --nodes=1 launch/slurm/train.sbatch
--config.rollout.drafter_path=/path/to/eagle-qwen7b`` (``RECIPE=7b``, the default). The first command warms the
EAGLE drafter up offline on the policy's own responses (``tlt_jax/drafter/warmup.py``); without
``rollout.drafter_path`` the run starts from a fresh drafter that only the online training teaches.

Layout. One mesh serves the trainer and the engines: (data, fsdp, tensor) = (-1, 2, 4), so 1 x 2 x 4 on one node.
The engines are the mesh's tensor-parallel groups (``rollout.num_slices = -1``, ``distributed.engine_meshes``): two
engines of 4 GPUs each, as TLT's SGLang engines (TP 4, 2 per node), each decoding half of the step's 512 responses
with no collective outside its TP group. The trainer runs FSDP over 2 x tensor-parallel 4 (TLT's trainer shards
FSDP over all 8 GPUs, but its rollout engines hold their own TP copy; here one mesh sets both, and TP 1 engines
would each hold the whole policy). On several nodes ``data`` takes the nodes (HSDP: FSDP and tensor inside a node,
``make_mesh`` orders the devices by node), two engines per node.

Speculation (TLT's): plain decoding while a wave has more than 32 live rows (``rollout.spec_threshold``), then a
bandit per batch bucket picks among TLT's EAGLE trees 8x4x48, 8x4x32, 8x4x16, 8x4x8 (depth x top-k x verify tokens)
and plain decoding, from measured tokens/s (``rollout.speculative = "adaptive"``). The drafter trains online
(``drafter.online``) on the engines whose share of the step is done while the other still decodes; samples do not
change (verification is lossless). The engines decode a bfloat16 TP copy of the float32 policy (``rollout.dtype``,
as SGLang's engines: half the weight and cache bytes of a float32 copy; compute is bfloat16 either way,
``model.dtype``), made from the trained weights once per RL step (``rollout.reshard``). Decode and verify steps
attend with the Triton tree-attention kernel (``rollout.attention_impl = "pallas"``; prefill with XLA's).

GRPO (configs/base.py ``tlt_grpo``): 64 prompts x 8 samples = 512 responses per step, temperature 0.9, lr 1e-6
constant, weight decay 0.01, grad clip 1.0, KL loss 0.001 low-var k3, clip 0.2, token-mean, mini-batches of 4 prompts
(16 updates per step). Response cap 2,048 tokens (GSM8K answers are short; TLT's 32K cap is for Eurus math/code).
Float32 parameters and AdamW state, rematerialised layers. The old-policy and reference log-prob passes run in
chunks sized by ``rl.logprob_max_gb`` (``rl.logprob_chunk_rows = 0``: 8 chunks of 64 rows at T = 3,072, not 64
chunks of ``rl.micro_batch_size``; ``steps.logprobs`` of benchmarks/results/plan_qwen2p5_7b_h100_1x8.json). Evaluation:
greedy on the first 512 test problems. Memory plan: ``python -m tlt_jax.plan --config=configs/qwen2p5_7b_gsm8k.py
--shape=qwen2.5-7b --target=h100:1x8``. Not run in this repository's CI (the CPU job is configs/gsm8k.py); reading
.parquet needs pyarrow.
"""

from tlt_jax.config import config_file

base = config_file(__file__, "base")

# TLT's bandit arms (examples/grpo_7B.sh: speculative_eagle_mab_configs 8_4_32 / 8_4_16 / 8_4_8 and the default
# 8_4_48), and plain decoding.
TLT_ARMS = "off,eagle:8x4x48,eagle:8x4x32,eagle:8x4x16,eagle:8x4x8"


def tlt_rollout(c):
    """TLT's adaptive rollout: engines on the mesh's TP groups, speculation at <= 32 live rows over TLT_ARMS, the
    drafter trained online on finished engines."""
    c.rollout.num_slices = -1  # one engine per tensor-parallel group
    c.rollout.speculative = "adaptive"
    c.rollout.spec_arms = TLT_ARMS
    c.rollout.spec_threshold = 32
    c.rollout.drafter_path = ""  # --config.rollout.drafter_path=DIR from tlt_jax.drafter.warmup (empty: fresh)
    c.drafter.online = True
    c.rollout.dtype = "bfloat16"  # the engines' copy (the trainer keeps float32 masters)
    # The Triton tree-attention kernel in decode and verify steps: faster than XLA's attention on an H200
    # (../shared/docs/gpu.md: decode at batch 64 21.2 against 49.4 ms, a 64-token verify 12.5 against 16.5 ms) and,
    # compiled for an H100, a 64-token verify moves 17.9 GB against 19.2 GB (benchmarks/results/gpu_compile_only_*).
    c.rollout.attention_impl = "pallas"
    return c


def get_config():
    c = tlt_rollout(base.tlt_grpo(base.get_config()))
    c.name = "qwen2p5_7b_gsm8k"
    c.model.source = "path"
    c.model.path = ""  # required: --config.model.path=/path/to/Qwen2.5-7B
    c.model.dtype = "bfloat16"
    c.model.remat = True
    c.mesh.data = -1
    c.mesh.fsdp = 2
    c.mesh.tensor = 4
    c.data.source = "gsm8k_file"
    c.data.train_path = ""  # required: --config.data.train_path=.../train.parquet
    c.data.eval_path = ""
    c.data.eval_size = 512
    c.data.prompts_per_step = 64
    c.data.max_prompt_len = 1024
    c.rollout.max_new_tokens = 2048
    c.rl.mini_batch_prompts = 4
    c.rl.micro_batch_size = 8
    c.reward.num_workers = 8
    c.eval.batch_size = 256
    c.checkpoint.every_steps = 30
    c.checkpoint.every_minutes = 30  # a step takes minutes: a run killed mid-step loses at most this and one step
    c.checkpoint.max_to_keep = 3
    # SLURM's stop ahead of the time limit (launch/slurm/train.sbatch): more than a step (512 responses of up to 2,048
    # tokens, 16 updates: minutes; time/step_s in metrics.jsonl) and a save, or the stop is killed mid-step.
    c.checkpoint.stop_lead_s = 1800
    c.train.num_steps = 116
    return c
