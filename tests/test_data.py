"""Data sources, prompt formatting and the grain pipeline (determinism, epochs, sharding, exact resume)."""

import json

import grain
import pytest

from tlt_jax.data import (
    PromptFormatter,
    filter_by_prompt_length,
    gsm_symbolic_examples,
    gsm_symbolic_splits,
    load_gsm8k_file,
    prompt_dataset,
)
from tlt_jax.rewards import score_gsm8k

ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "How much is 1000 + 234?", "answer": "It is 1,234 dollars.\n#### 1,234"},
    {"question": "No final answer?", "answer": "It is 7."},
    {"answer": "#### 3"},
    {"question": "Negative?", "answer": "#### -4"},
    ["not", "an", "object"],
    {"question": "Empty final?", "answer": "####"},
]


def _write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n\n")
    return path


def test_load_gsm8k_jsonl_skips_and_counts_malformed_rows(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS, extra_lines=['{"question": "truncated', "not json"])
    loaded = load_gsm8k_file(path)
    assert [ex["ground_truth"] for ex in loaded.examples] == ["5", "1234", "-4"]
    assert [ex["id"] for ex in loaded.examples] == ["train-0", "train-1", "train-4"]
    assert loaded.examples[1]["question"] == "How much is 1000 + 234?"
    assert loaded.examples[1]["prompt_text"] == PromptFormatter()("How much is 1000 + 234?")
    assert loaded.num_skipped == 6
    assert loaded.skipped_by_reason == {
        "no_final_answer": 2,
        "missing_field": 1,
        "not_an_object": 1,
        "invalid_json": 2,
    }
    for ex in loaded.examples:  # ground truths are scoreable
        assert score_gsm8k(f"#### {ex['ground_truth']}", ex["ground_truth"]) == 1.0


def test_load_gsm8k_errors_name_the_path_and_format(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*\.jsonl.*'question'.*'answer'.*####"):
        load_gsm8k_file(missing)
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_gsm8k_file(tmp_path / "data.csv")


def test_load_gsm8k_parquet(tmp_path):
    path = tmp_path / "test.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([ROWS[0], ROWS[2], ROWS[4]]), path)
    loaded = load_gsm8k_file(path)
    assert [ex["ground_truth"] for ex in loaded.examples] == ["5", "-4"] and loaded.num_skipped == 1


def test_gsm_symbolic_splits_are_disjoint_and_deterministic():
    splits = gsm_symbolic_splits(train_size=50, eval_size=50, train_seed=0, eval_seed=1_000_000)
    train_q = {ex["question"] for ex in splits.train}
    eval_q = {ex["question"] for ex in splits.eval}
    assert len(train_q) == len(splits.train) == 50 and len(eval_q) == len(splits.eval) == 50
    assert not train_q & eval_q
    assert set(splits.train[0]) == {"prompt_text", "question", "ground_truth", "id"}
    assert splits.train[0]["id"].startswith("gsm_symbolic-0-") and splits.eval[0]["id"].startswith(
        "gsm_symbolic-1000000-"
    )
    for ex in splits.train + splits.eval:
        assert score_gsm8k(f"#### {ex['ground_truth']}", ex["ground_truth"]) == 1.0
    assert gsm_symbolic_splits(50, 50, 0, 1_000_000) == splits
    assert gsm_symbolic_examples(50, seed=0) != gsm_symbolic_examples(50, seed=7)
    # Templates with few variables repeat questions even across distant seeds; the splits drop those from train.
    raw_train = {ex["question"] for ex in gsm_symbolic_examples(2000, seed=0)}
    raw_eval = {ex["question"] for ex in gsm_symbolic_examples(500, seed=1_000_000)}
    assert raw_train & raw_eval
    big = gsm_symbolic_splits(train_size=2000, eval_size=500, train_seed=0, eval_seed=1_000_000)
    assert len(big.train) == 2000 and not {ex["question"] for ex in big.train} & raw_eval
    # Overlapping seed ranges are rejected: reasoning-gym seeds item i with seed + i.
    with pytest.raises(ValueError, match="overlap"):
        gsm_symbolic_splits(train_size=50, eval_size=20, train_seed=0, eval_seed=30)


def _toy_chat_template(messages):
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"


def test_prompt_formatter_and_length_filter():
    plain = PromptFormatter()("What is 2 + 3?")
    assert "step by step" in plain and "####" in plain and plain.endswith("Question: What is 2 + 3?\nAnswer:")

    chat = PromptFormatter(chat_template=_toy_chat_template, instruction="Think, then '#### N'.")
    assert chat("Q?") == "<|system|>Think, then '#### N'.<|end|><|user|>Q?<|end|><|assistant|>"
    no_system = PromptFormatter(chat_template=_toy_chat_template, instruction="Be brief.", use_system_role=False)
    assert no_system.messages("Q?") == [{"role": "user", "content": "Be brief.\n\nQ?"}]
    assert no_system("Q?") == "<|user|>Be brief.\n\nQ?<|end|><|assistant|>"

    examples = [{"prompt_text": "one two three"}, {"prompt_text": "one"}, {"prompt_text": "a b c d e"}]
    kept, num_filtered = filter_by_prompt_length(examples, str.split, max_prompt_len=3)
    assert kept == examples[:2] and num_filtered == 1


EXAMPLES = [{"prompt_text": f"p{i}", "question": f"q{i}", "ground_truth": str(i), "id": f"ex-{i}"} for i in range(10)]


def _ids(batches):
    return [[ex["id"] for ex in batch] for batch in batches]


def test_pipeline_shuffle_epochs_and_remainder():
    make = lambda **kw: list(prompt_dataset(EXAMPLES, shard_index=0, shard_count=1, **kw))
    two_epochs = make(batch_size=5, seed=3, num_epochs=2)
    assert len(two_epochs) == 4 and all(isinstance(b, list) and len(b) == 5 for b in two_epochs)
    first, second = sum(_ids(two_epochs[:2]), []), sum(_ids(two_epochs[2:]), [])
    assert sorted(first) == sorted(second) == sorted(ex["id"] for ex in EXAMPLES)  # each epoch sees everything once
    assert first != second  # reshuffled per epoch
    assert _ids(make(batch_size=5, seed=3, num_epochs=2)) == _ids(two_epochs)  # deterministic
    assert _ids(make(batch_size=5, seed=4, num_epochs=2)) != _ids(two_epochs)
    assert len(make(batch_size=4, seed=0)) == 2  # 10 examples, partial batch dropped
    assert [len(b) for b in make(batch_size=4, seed=0, drop_remainder=False)] == [4, 4, 2]
    assert sum(_ids(make(batch_size=10, shuffle=False)), []) == [ex["id"] for ex in EXAMPLES]


def test_pipeline_shards_partition_the_global_batch():
    whole = _ids(prompt_dataset(EXAMPLES, 4, seed=1, num_epochs=2, shard_index=0, shard_count=1))
    shards = [_ids(prompt_dataset(EXAMPLES, 4, seed=1, num_epochs=2, shard_index=i, shard_count=2)) for i in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(whole) == 5
    for step, global_batch in enumerate(whole):
        assert len(shards[0][step]) == 2 and sorted(shards[0][step] + shards[1][step]) == sorted(global_batch)
    assert _ids(prompt_dataset(EXAMPLES, 4, seed=1, num_epochs=2)) == whole  # default: jax process 0 of 1
    with pytest.raises(ValueError, match="multiple of the shard count"):
        prompt_dataset(EXAMPLES, 5, shard_index=0, shard_count=2)
    with pytest.raises(ValueError, match="both shard_index and shard_count"):
        prompt_dataset(EXAMPLES, 4, shard_index=1)


def test_iterator_resumes_exactly_from_state():
    ds = prompt_dataset(EXAMPLES, 3, seed=5, num_epochs=None, shard_index=0, shard_count=1)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = _ids([next(it), next(it)])
    fresh = iter(ds)
    fresh.set_state(state)
    assert _ids([next(fresh), next(fresh)]) == expected


def test_iterator_state_through_orbax(tmp_path):
    import orbax.checkpoint as ocp

    ds = prompt_dataset(EXAMPLES, 3, seed=5, num_epochs=None, shard_index=0, shard_count=1)
    it = iter(ds)
    for _ in range(3):
        next(it)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    expected = _ids([next(it), next(it)])

    fresh = iter(ds)
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        restored = mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    assert _ids([next(restored.data), next(restored.data)]) == expected
