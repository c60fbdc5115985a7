"""Batch and cache-length buckets: the finite set of shapes every compiled step is specialised to."""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_BATCH_BUCKETS = (256, 128, 64, 32, 16, 8, 4, 2, 1)
MIN_LENGTH_BUCKET = 16


def batch_buckets(max_batch: int, buckets: Iterable[int] = DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """Ascending batch buckets clipped to ``max_batch``; max_batch itself is always a bucket."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = sorted({int(b) for b in buckets if 0 < b <= max_batch} | {int(max_batch)})
    return tuple(out)


def length_buckets(max_len: int, buckets: Iterable[int] | None = None) -> tuple[int, ...]:
    """Ascending cache-length buckets up to ``max_len`` (default: powers of two from 16, then max_len)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if buckets is None:
        buckets, b = [], MIN_LENGTH_BUCKET
        while b < max_len:
            buckets.append(b)
            b *= 2
    out = sorted({int(b) for b in buckets if 0 < b <= max_len} | {int(max_len)})
    return tuple(out)


def pick(buckets: tuple[int, ...], need: int) -> int:
    """Smallest bucket >= need (buckets ascending)."""
    for b in buckets:
        if b >= need:
            return b
    raise ValueError(f"{need} exceeds the largest bucket {buckets[-1]}")
