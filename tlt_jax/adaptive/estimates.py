"""The bandit's measurements: per batch bucket a sliding window of round-trip observations, the per-arm medians over
it, and estimates for the arms a bucket has not measured, transferred from the nearest bucket that measured them.

Transfer (``Windows.estimates``): an arm ``a`` with no observation in bucket ``b`` gets the estimate
``median_b(r) * median_b'(a) / median_b'(r)`` from the nearest bucket ``b'`` (distance |log2(b'/b)|, ties: the larger
bucket) whose window holds ``a`` and a reference arm ``r`` that ``b`` also measured (the one ``b`` measured most often).
Relative speeds carry over between neighbouring batch sizes, absolute tokens/s do not (a bucket twice as large emits
about twice the tokens per step). A bucket with no observation at all takes the nearest measured bucket's medians as
they are: only their ratios matter for its first choice. Only measurements transfer (not transferred estimates), and
only fresh ones: ``a``'s newest observation in ``b'`` must be among the last ``window`` observations of the whole
bandit, so a bucket no longer visited does not speak for its neighbours forever. An estimate records its distance in
octaves; the bandit trusts it less the farther it comes from.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Estimate:
    """rate: the reward (window median, or transferred). seconds: round-trip seconds on the same basis (0 = unknown).
    source: the bucket the numbers come from (the bucket itself when measured there). count: observations of the arm
    behind it (in ``source``). newest: sequence number of the newest one. distance: |log2(source / bucket)| in
    octaves, 0 when measured in the bucket itself."""

    rate: float
    seconds: float
    source: int
    count: int
    newest: int = -1
    distance: float = 0.0

    @property
    def transferred(self) -> bool:
        return self.distance > 0


class _Bucket:
    """One bucket's window: the arm of each observation in order, and per arm its rewards, seconds, sequence numbers."""

    def __init__(self, n_arms: int):
        self.order: collections.deque = collections.deque()
        self.rate = [collections.deque() for _ in range(n_arms)]
        self.secs = [collections.deque() for _ in range(n_arms)]
        self.seq = [collections.deque() for _ in range(n_arms)]


class Windows:
    """Per bucket the last ``window`` observations (arm index, reward, round-trip seconds, sequence number)."""

    def __init__(self, window: int, n_arms: int):
        self.window, self.n_arms = int(window), int(n_arms)
        self.obs: dict[int, _Bucket] = {}
        self.seq = 0  # observations recorded so far, all buckets
        self._cache: dict[int, dict[int, Estimate]] = {}
        self._noise: float | None = None

    def add(self, bucket: int, arm: int, rate: float, seconds: float, seq: int | None = None) -> None:
        seq = self.seq if seq is None else int(seq)
        w = self.obs.setdefault(bucket, _Bucket(self.n_arms))
        w.order.append(arm)
        w.rate[arm].append(rate)
        w.secs[arm].append(seconds)
        w.seq[arm].append(seq)
        while len(w.order) > self.window:  # the bucket's oldest observation leaves its arm's window
            old = w.order.popleft()
            w.rate[old].popleft()
            w.secs[old].popleft()
            w.seq[old].popleft()
        self.seq = max(self.seq, seq + 1)
        self._cache.pop(bucket, None)
        self._noise = None

    def noise(self) -> float:
        """The spread of one observation: 1.4826 x the median absolute deviation of log reward from its (bucket, arm)
        window median, pooled over every bucket (the host clock's and the workload's noise; 0 until some arm has two
        observations in a bucket). Sets how far a few observations can be trusted."""
        if self._noise is None:
            res = []
            for bucket, w in self.obs.items():
                for arm, e in self.measured(bucket).items():
                    if e.count > 1:
                        r = np.maximum(np.fromiter(w.rate[arm], float, e.count), 1e-30)
                        res.append(np.abs(np.log(r / max(e.rate, 1e-30))))
            self._noise = 1.4826 * float(np.median(np.concatenate(res))) if res else 0.0
        return self._noise

    def entries(self, bucket: int) -> list[tuple[int, float, float, int]]:
        """The bucket's window as (arm, reward, seconds, sequence number), oldest first."""
        w = self.obs.get(bucket)
        if w is None:
            return []
        its = [(iter(r), iter(s), iter(q)) for r, s, q in zip(w.rate, w.secs, w.seq, strict=True)]
        return [(a, next(its[a][0]), next(its[a][1]), next(its[a][2])) for a in w.order]

    def measured(self, bucket: int) -> dict[int, Estimate]:
        """Per arm observed in the bucket's window: median reward, median seconds (over the observations that carry
        a time), count; ``source`` is the bucket. Cached until the bucket's next observation."""
        out = self._cache.get(bucket)
        if out is None:
            out = {}
            w = self.obs.get(bucket)
            for arm in range(self.n_arms) if w is not None else ():
                n = len(w.rate[arm])
                if n == 0:
                    continue
                secs = np.fromiter(w.secs[arm], float, n)
                secs = secs[secs > 0]
                out[arm] = Estimate(
                    rate=float(np.median(np.fromiter(w.rate[arm], float, n))),
                    seconds=float(np.median(secs)) if secs.size else 0.0,
                    source=bucket,
                    count=n,
                    newest=w.seq[arm][-1],
                )
            self._cache[bucket] = out
        return out

    def fresh(self, e: Estimate) -> bool:
        """Whether the newest observation behind ``e`` is among the bandit's last ``window`` observations."""
        return e.newest >= self.seq - self.window

    def estimates(self, bucket: int, arms: Iterable[int], transfer: bool) -> dict[int, Estimate]:
        """Estimates of ``arms`` in ``bucket``: measured ones, then (with ``transfer``) transferred ones; arms with
        neither are absent (nothing is known of them here)."""
        arms = list(arms)
        own = self.measured(bucket)
        out = {a: own[a] for a in arms if a in own}
        if not transfer or len(out) == len(arms):
            return out
        near = self._neighbours(bucket)
        if not own:  # nothing measured here: the nearest measured bucket's medians, one scale for every arm
            for b in near:
                nb = {a: e for a, e in self.measured(b).items() if a in arms and self.fresh(e)}
                if nb:
                    d = abs(math.log2(b / bucket))
                    return {a: dataclasses.replace(e, distance=d) for a, e in nb.items()}
            return out
        for a in arms:
            if a in out:
                continue
            for b in near:
                nb = self.measured(b)
                refs = [r for r in own if r in nb and r != a and own[r].rate > 0 and nb[r].rate > 0]
                if a not in nb or not refs or not self.fresh(nb[a]):
                    continue
                r = max(refs, key=lambda r: (own[r].count, -r))
                secs = 0.0
                if own[r].seconds > 0 and nb[r].seconds > 0 and nb[a].seconds > 0:
                    secs = own[r].seconds * nb[a].seconds / nb[r].seconds
                rate = own[r].rate * nb[a].rate / nb[r].rate
                out[a] = Estimate(rate, secs, b, nb[a].count, nb[a].newest, abs(math.log2(b / bucket)))
                break
        return out

    def _neighbours(self, bucket: int) -> Sequence[int]:
        others = [b for b, w in self.obs.items() if b != bucket and w.order]
        return sorted(others, key=lambda b: (abs(math.log2(b / bucket)), -b))
