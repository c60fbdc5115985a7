"""The prompt pipeline: a grain dataset of per-step batches (lists of example dicts), shuffled, repeated, sharded.

Order of operations: global shuffle (seeded, reshuffled each epoch) -> repeat -> per-process stride shard ->
batch. At every step the processes' batches together are exactly the global batch of an unsharded pipeline, so the
data seen does not depend on the process count. Iterators are checkpointable with ``get_state`` / ``set_state`` and
with orbax through ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain

__all__ = ["prompt_dataset"]


def _shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if shard_index is None and shard_count is None:
        import jax

        return jax.process_index(), jax.process_count()
    if shard_index is None or shard_count is None:
        raise ValueError("give both shard_index and shard_count, or neither (then JAX's process index/count)")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    return shard_index, shard_count


def prompt_dataset(
    examples: Sequence[dict],
    batch_size: int,
    *,
    seed: int = 0,
    num_epochs: int | None = 1,
    shuffle: bool = True,
    shard_index: int | None = None,
    shard_count: int | None = None,
    drop_remainder: bool = True,
) -> grain.IterDataset:
    """A dataset whose iterator yields lists of ``batch_size // shard_count`` examples for this process.

    ``batch_size`` is the global number of prompts per step; ``num_epochs=None`` repeats forever. Batches run
    across epoch boundaries; with ``drop_remainder`` a final partial batch is dropped. ``iter()`` on the result
    gives a checkpointable iterator.
    """
    if not examples:
        raise ValueError("no examples to build a prompt dataset from")
    shard_index, shard_count = _shard(shard_index, shard_count)
    if batch_size < 1 or batch_size % shard_count:
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of the shard count {shard_count}")
    ds = grain.MapDataset.source(list(examples))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    ds = ds[shard_index::shard_count]
    ds = ds.batch(batch_size // shard_count, drop_remainder=drop_remainder, batch_fn=list)
    # Elements are already in memory: no reader threads (they would only contend for the GIL).
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
