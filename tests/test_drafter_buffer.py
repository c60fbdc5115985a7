"""Drafter data buffer: windows aligned with their tokens, byte bound with oldest-first drops, step rollover (current
+ previous step), fixed-shape packed batches."""

import numpy as np
import pytest

from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.rollout import RolloutResult

H = 4


def window(m, w, tag=0.0):
    """A fake captured window of the last w of m generated tokens: entry i holds (position index, tag)."""
    start = m - w
    hid = np.zeros((w, H), np.float32)
    hid[:, 0] = np.arange(start, start + w)
    hid[:, 1] = tag
    return hid, start


def sample_bytes(w):
    return w * 4 + w * H * 4


def test_window_tokens_line_up_with_hidden_positions():
    buf = DrafterBuffer(max_bytes=10_000)
    buf.start_step(1)
    prompt, gen = [10, 11, 12], [20, 21, 22, 23, 24]
    hid, start = window(len(gen), 3)  # h at positions 2 + 2 .. 2 + 4: tokens gen[1], gen[2], gen[3]
    assert buf.add(prompt, gen, hid, start)
    s = buf.samples[0]
    np.testing.assert_array_equal(s.ids, [21, 22, 23])
    hid, start = window(len(gen), 5)  # the whole response: the first position is the prompt's last token
    buf.add(prompt, gen, hid, 0)
    np.testing.assert_array_equal(buf.samples[1].ids, [12, 20, 21, 22, 23])
    b = buf.batch(row_len=8, num_rows=1, seed=0)
    assert b.next_tokens.shape == (1, 8) and b.features.shape == (1, 8, H)
    # Each pair is (h_t, x_{t+1}) -> h_{t+1}: 2 + 4 pairs, two segments, all in the loss.
    assert sorted(np.unique(b.segment_ids[0]).tolist()) == [0, 1, 2] and b.loss_mask.sum() == 6
    seg = b.segment_ids[0] > 0
    np.testing.assert_array_equal(b.targets[0, seg, 0] - b.features[0, seg, 0], np.ones(6))
    assert set(b.next_tokens[0, seg].tolist()) == {20, 21, 22, 23}
    with pytest.raises(ValueError, match="does not fit 3 prompt and 5 generated tokens"):
        buf.add(prompt, gen, np.zeros((4, H), np.float32), 3)
    assert not buf.add(prompt, gen, np.zeros((1, H), np.float32), 4) and buf.skipped == 1  # no pair in 1 position


def test_byte_bound_drops_oldest_and_counts():
    w = 4
    buf = DrafterBuffer(max_bytes=3 * sample_bytes(w))
    buf.start_step(1)
    for k in range(5):
        hid, start = window(6, w, tag=k)
        assert buf.add([1, 2], list(range(6)), hid, start)
        assert buf.nbytes <= buf.max_bytes
    assert len(buf) == 3 and buf.dropped == 2
    assert [s.hidden[0, 1] for s in buf.samples] == [2, 3, 4]  # the oldest went first
    assert buf.nbytes == 3 * sample_bytes(w)
    assert not buf.add([1], list(range(40)), *window(40, 30)) and buf.dropped == 3  # larger than the whole budget
    assert len(buf) == 3


def test_step_rollover_keeps_current_and_previous():
    buf = DrafterBuffer(max_bytes=10**6)
    with pytest.raises(ValueError, match="start_step"):
        buf.add([1], [2, 3], *window(2, 2))
    for step in (1, 2, 3):
        buf.start_step(step)
        for _ in range(step):  # step s adds s samples
            buf.add([1], [2, 3, 4], *window(3, 2, tag=step))
    st = buf.stats()
    assert st["buffer/current_step_samples"] == 3 and st["buffer/previous_step_samples"] == 2
    assert buf.expired == 1 and {s.step for s in buf.samples} == {2, 3}
    with pytest.raises(ValueError, match="must not go back"):
        buf.start_step(2)
    one = DrafterBuffer(max_bytes=10**6, keep_steps=1)
    one.start_step(1)
    one.add([1], [2, 3], *window(2, 2))
    one.start_step(2)
    assert len(one) == 0 and one.expired == 1 and not one.ready()
    with pytest.raises(ValueError, match="buffer is empty"):
        one.batch(8, 1, 0)


def test_add_result_and_seeded_batches():
    buf = DrafterBuffer(max_bytes=10**6)
    buf.start_step(1)
    prompts = [[5, 6], [7]]
    tokens = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [3]]]
    hidden, starts = [], []
    for row in tokens:
        hs, ss = [], []
        for gen in row:
            h, s = window(len(gen), min(3, len(gen)))
            hs.append(h)
            ss.append(s)
        hidden.append(hs)
        starts.append(ss)
    hidden[0][1] = None  # dropped by the engine's capture cap
    res = RolloutResult(tokens, [[[]] * 2] * 2, [["length"] * 2] * 2, {}, hidden, starts)
    assert buf.add_result(prompts, res) == 2 and buf.skipped == 2  # one None, one single-position window
    np.testing.assert_array_equal(buf.samples[1].ids, [6, 7, 8])
    a, b, c = (buf.batch(4, 2, seed) for seed in (0, 0, 1))
    np.testing.assert_array_equal(a.next_tokens, b.next_tokens)
    assert a.next_tokens.shape == c.next_tokens.shape == (2, 4)
    with pytest.raises(ValueError, match="captured no hidden states"):
        buf.add_result(prompts, RolloutResult(tokens, [], [], {}))
    with pytest.raises(ValueError, match="max_bytes"):
        DrafterBuffer(max_bytes=0)


def test_prompt_context_is_attended_but_not_trained_on():
    """A window reaching 2 positions into the prompt (hidden_start -2): its ids start 2 tokens before the prompt's last,
    its pairs predicting prompt tokens are packed (context) with no loss, in training and held-out batches alike, and
    a window may not start before the prompt."""
    buf = DrafterBuffer(max_bytes=10_000)
    buf.start_step(1)
    prompt, gen = [10, 11, 12, 13], [20, 21, 22]
    hid = np.zeros((5, H), np.float32)
    hid[:, 0] = np.arange(5)
    assert buf.add(prompt, gen, hid, -2)
    s = buf.samples[0]
    np.testing.assert_array_equal(s.ids, [11, 12, 13, 20, 21])
    assert s.response_start == 3
    b = buf.batch(row_len=8, num_rows=1, seed=0)
    seg = b.segment_ids[0] > 0
    np.testing.assert_array_equal(b.next_tokens[0, seg], [12, 13, 20, 21])
    np.testing.assert_array_equal(b.loss_mask[0, seg], [0, 0, 1, 1])  # no loss on predicting the prompt
    held_out = buf.step_batch(1, row_len=8, num_rows=1)  # the held-out top-1's batch: scored on the same pairs
    np.testing.assert_array_equal(held_out.loss_mask, b.loss_mask)
    assert buf.step_batch(2, row_len=8, num_rows=1) is None
    with pytest.raises(ValueError, match="does not fit 4 prompt and 3 generated tokens"):
        buf.add(prompt, gen, np.zeros((5, H), np.float32), -4)
    assert not buf.add(prompt, gen, np.zeros((3, H), np.float32), -2) and buf.skipped == 1  # context only, no pair
