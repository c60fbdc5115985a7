"""The tiny task with a long tail and TLT's adaptive drafter on: spot training of the drafter on idle slices.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tlt_jax.main --config=configs/tiny_tlt.py \
        --workdir=runs/tiny_tlt

configs/tiny.py (a random 2-layer model learns to answer with a target token), but every prompt carries its own
answer length (``data.synthetic.answer_len_sigma``: log-normal, median a quarter of the 16-token cap), so rollout
slices finish at different times. Two slices (two devices; on a CPU, simulate them with the XLA flag above), each
decoding half of the prompt groups with lossless EAGLE tree speculation from a freshly initialised drafter; a slice
whose share has finished trains the drafter while the other still decodes, and only then
(``drafter.steps_without_idle=0``). workdir/timeline.jsonl and plots/timeline.png show the slices busy / idle /
training; ``rollout/accept_length`` shows the drafter learning. Used by tests/test_online_tail.py.
"""

from tlt_jax.config import config_file

tiny = config_file(__file__, "tiny")


def get_config():
    c = tiny.get_config()
    c.name = "tiny_tlt"
    c.data.synthetic.answer_len_sigma = 1.0
    c.rollout.num_slices = 2
    c.rollout.speculative = "eagle"  # an empty drafter_path: a fresh drafter that online training teaches
    c.rollout.spec_depth = 3
    c.rollout.spec_topk = 2
    c.rollout.spec_verify_tokens = 6
    c.drafter.online = True
    c.drafter.lr = 3e-3
    c.drafter.steps_without_idle = 0
    c.drafter.row_len = 64
    c.drafter.window = 16
    return c
