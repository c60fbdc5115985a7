"""BEG-MAB: a bucketed epsilon-greedy bandit choosing the speculation arm for each batch-size bucket.

One bandit per batch bucket (the engine's compiled batch buckets; a ``table`` may restrict a bucket to some arms). The
reward of an arm is the tokens per second of its steps, reported by the engine once per host round trip as
(arm, bucket, tokens, seconds). Choosing an arm for a bucket:

1. arms with no observation in the bucket's window are tried first, in the configured order (no randomness);
2. otherwise, with probability ``epsilon`` a uniformly random arm of the bucket (exploration), else the arm with the
   highest median reward over its observations in the window (ties: the earlier arm).

The window is the bucket's last ``window`` observations over all its arms. An arm the bandit stops choosing therefore
ages out of the window and is tried again: after the best arm changes (a drafter that improved, a different
temperature) every stale estimate is gone within ``window`` observations. Randomness comes from a seeded PCG64
generator drawn only at step 2, so the decisions are a function of the seed and the reported numbers; in several
processes every process must report the same numbers (``tlt_jax.adaptive.sync.agreed_seconds``).

The state (observations, generator, counters) round-trips through ``state_dict`` / ``load_state_dict`` as JSON values,
so it lives in checkpoints and carries across generate calls.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tlt_jax.adaptive.arms import Arm, parse_arm, parse_arms

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """arms: the candidate arms (strings or Arms; "off" = plain decoding is an arm like any other). epsilon:
    exploration probability. window: observations per bucket the medians are taken over. seed: of the exploration
    generator. table: optional {bucket: arms} restricting a batch bucket to a subset of ``arms`` (other buckets use
    all arms; a bucket with one arm never explores)."""

    arms: tuple[Arm, ...]
    epsilon: float = 0.1
    window: int = 300
    seed: int = 0
    table: tuple[tuple[int, tuple[Arm, ...]], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "arms", parse_arms(self.arms))
        table = self.table.items() if isinstance(self.table, Mapping) else self.table
        norm = []
        for bucket, arms in table:
            if int(bucket) != bucket or bucket < 1:
                raise ValueError(f"BanditConfig.table: bucket {bucket!r} must be a batch size >= 1")
            arms = parse_arms(arms)
            extra = [str(a) for a in arms if a not in self.arms]
            if extra:
                raise ValueError(
                    f"BanditConfig.table[{bucket}] names arms {extra} that are not in arms; add them there"
                )
            norm.append((int(bucket), arms))
        if len({b for b, _ in norm}) != len(norm):
            raise ValueError("BanditConfig.table lists a bucket twice")
        object.__setattr__(self, "table", tuple(sorted(norm)))
        if not 0.0 <= float(self.epsilon) <= 1.0:
            raise ValueError(f"BanditConfig.epsilon must be in [0, 1], got {self.epsilon}")
        if int(self.window) != self.window or self.window < 1:
            raise ValueError(f"BanditConfig.window must be an integer >= 1, got {self.window}")
        if int(self.seed) != self.seed or self.seed < 0:
            raise ValueError(f"BanditConfig.seed must be an integer >= 0, got {self.seed}")

    def arms_for(self, bucket: int) -> tuple[Arm, ...]:
        """The arms the bandit chooses from in this batch bucket."""
        return dict(self.table).get(int(bucket), self.arms)

    def reachable(self, batch_buckets: Sequence[int], threshold: int, compaction: bool = True) -> list[tuple[Arm, int]]:
        """Every (arm, batch bucket) a rollout can run: speculative arms only in buckets the gate's threshold reaches
        (with compaction a wave with at most ``threshold`` live rows sits in the smallest bucket holding them),
        "off" wherever the engine decodes plainly (every bucket). For precompiling the pool."""
        buckets = sorted(int(b) for b in batch_buckets)
        tail = buckets[-1]
        if compaction:
            tail = next((b for b in buckets if b >= max(1, threshold)), buckets[-1])
        out = [(Arm("off"), b) for b in buckets]
        if threshold < 1:
            return out
        for b in buckets:
            if b > tail:
                continue
            out.extend((a, b) for a in self.arms_for(b) if a.speculative)
        return out


class Bandit:
    """The per-bucket epsilon-greedy bandit over ``config.arms``. ``choose(bucket)`` → Arm; ``observe(arm, bucket,
    tokens, seconds, steps)`` after each round trip that ran the arm; ``stats()`` for the metrics."""

    def __init__(self, config: BanditConfig):
        self.config = config
        self._index = {a: i for i, a in enumerate(config.arms)}
        self._rng = np.random.Generator(np.random.PCG64(config.seed))
        # bucket -> arm indices of the bucket's last `window` observations (oldest first), and per arm their tokens/s
        self._order: dict[int, collections.deque] = {}
        self._rates: dict[int, list[collections.deque]] = {}
        self._median_cache: dict[int, dict[int, float]] = {}
        self._tokens = np.zeros(len(config.arms), np.int64)
        self._seconds = np.zeros(len(config.arms), np.float64)
        self._steps: dict[int, dict[int, int]] = {}
        self._choices: dict[int, dict[str, int]] = {}  # bucket -> {"untried" | "explore" | "exploit": count}
        self._best: dict[int, int] = {}
        self._best_changes: dict[int, int] = {}

    # ---- decisions ------------------------------------------------------------------------------------------

    def choose(self, bucket: int) -> Arm:
        """The arm to run next in this batch bucket (see the module docstring for the rule)."""
        bucket = self._bucket(bucket)
        arms = self.config.arms_for(bucket)
        counts = self._choices.setdefault(bucket, dict(untried=0, explore=0, exploit=0))
        if len(arms) == 1:
            counts["exploit"] += 1
            return arms[0]
        med = self._medians(bucket)
        for a in arms:
            if self._index[a] not in med:
                counts["untried"] += 1
                return a
        if self._rng.random() < self.config.epsilon:
            counts["explore"] += 1
            return arms[int(self._rng.integers(len(arms)))]
        counts["exploit"] += 1
        return self._argmax(arms, med)

    def observe(self, arm: Arm | str, bucket: int, tokens: int, seconds: float, steps: int = 1) -> None:
        """Record one round trip of ``arm`` in ``bucket``: ``tokens`` emitted in ``seconds`` over ``steps`` decode or
        verify steps."""
        arm, bucket = parse_arm(arm), self._bucket(bucket)
        if arm not in self._index:
            raise ValueError(
                f"observe: arm '{arm}' is not one of the bandit's arms {[str(a) for a in self.config.arms]}"
            )
        if int(tokens) != tokens or tokens < 0:
            raise ValueError(f"observe: tokens must be an integer >= 0, got {tokens}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"observe: steps must be an integer >= 0, got {steps}")
        if not np.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"observe: seconds must be a finite time > 0, got {seconds} (time the round trip itself)")
        i = self._index[arm]
        self._append(bucket, i, float(tokens) / float(seconds))
        self._tokens[i] += int(tokens)
        self._seconds[i] += float(seconds)
        per = self._steps.setdefault(bucket, {})
        per[i] = per.get(i, 0) + int(steps)
        self._track_best(bucket)

    def best(self, bucket: int) -> Arm | None:
        """The arm with the highest median reward in the bucket's window (None before any observation)."""
        bucket = self._bucket(bucket)
        med = self._medians(bucket)
        arms = [a for a in self.config.arms_for(bucket) if self._index[a] in med]
        return self._argmax(arms, med) if arms else None

    def medians(self, bucket: int) -> dict[Arm, float]:
        """Median tokens/s per arm over the bucket's window (arms with observations only)."""
        med = self._medians(self._bucket(bucket))
        return {self.config.arms[i]: v for i, v in sorted(med.items())}

    def _append(self, bucket: int, i: int, rate: float) -> None:
        order = self._order.setdefault(bucket, collections.deque())
        rates = self._rates.setdefault(bucket, [collections.deque() for _ in self.config.arms])
        order.append(i)
        rates[i].append(rate)
        while len(order) > self.config.window:  # the oldest observation of the bucket leaves its arm's window
            rates[order.popleft()].popleft()
        self._median_cache.pop(bucket, None)

    def _medians(self, bucket: int) -> dict[int, float]:
        med = self._median_cache.get(bucket)
        if med is None:
            rates = self._rates.get(bucket, ())
            med = {i: float(np.median(np.fromiter(r, float, len(r)))) for i, r in enumerate(rates) if r}
            self._median_cache[bucket] = med
        return med

    def _window(self, bucket: int) -> list[tuple[int, float]]:
        """The bucket's window as (arm index, tokens/s), oldest first."""
        rates = [iter(r) for r in self._rates.get(bucket, ())]
        return [(i, next(rates[i])) for i in self._order.get(bucket, ())]

    def _argmax(self, arms: Sequence[Arm], med: dict[int, float]) -> Arm:
        return max(arms, key=lambda a: (med[self._index[a]], -self._index[a]))

    def _track_best(self, bucket: int) -> None:
        best = self.best(bucket)
        if best is None:  # only arms outside this bucket's table were observed
            return
        i = self._index[best]
        if bucket in self._best and self._best[bucket] != i:
            self._best_changes[bucket] = self._best_changes.get(bucket, 0) + 1
        self._best[bucket] = i

    @staticmethod
    def _bucket(bucket) -> int:
        if int(bucket) != bucket or bucket < 1:
            raise ValueError(f"bucket must be a batch size >= 1, got {bucket!r}")
        return int(bucket)

    # ---- metrics ----------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """steps: {bucket: {arm: steps}}; tokens_per_s: {arm: tokens / seconds over every observation};
        median_tokens_per_s: {bucket: {arm: window median}}; best: {bucket: arm}; choices: {bucket: {untried,
        explore, exploit}}; best_changes: {bucket: times the best arm changed}. Arms as strings."""
        names = [str(a) for a in self.config.arms]
        return dict(
            steps={b: {names[i]: s for i, s in sorted(per.items())} for b, per in sorted(self._steps.items())},
            tokens_per_s={
                names[i]: float(self._tokens[i] / self._seconds[i]) for i in range(len(names)) if self._seconds[i] > 0
            },
            median_tokens_per_s={b: {str(a): v for a, v in self.medians(b).items()} for b in sorted(self._order)},
            best={b: names[i] for b, i in sorted(self._best.items())},
            choices={b: dict(c) for b, c in sorted(self._choices.items())},
            best_changes=dict(sorted(self._best_changes.items())),
        )

    # ---- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (bucket keys as strings, the generator's 128-bit words as decimal strings)."""
        names = [str(a) for a in self.config.arms]
        g = self._rng.bit_generator.state
        return dict(
            version=STATE_VERSION,
            arms=names,
            rng=dict(
                state=str(g["state"]["state"]),
                inc=str(g["state"]["inc"]),
                has_uint32=int(g["has_uint32"]),
                uinteger=int(g["uinteger"]),
            ),
            observations={str(b): [[names[i], r] for i, r in self._window(b)] for b in sorted(self._order)},
            tokens=self._tokens.tolist(),
            seconds=self._seconds.tolist(),
            steps={str(b): {names[i]: s for i, s in per.items()} for b, per in sorted(self._steps.items())},
            choices={str(b): dict(c) for b, c in sorted(self._choices.items())},
            best={str(b): names[i] for b, i in sorted(self._best.items())},
            best_changes={str(b): n for b, n in sorted(self._best_changes.items())},
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output. The saved arms must be the configured arms (same order): a checkpoint of
        another arm set would mis-assign the counters. A smaller window keeps each bucket's newest observations."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"bandit state version {state.get('version')!r} is not {STATE_VERSION}; it is from "
                "another tlt_jax version"
            )
        names = [str(a) for a in self.config.arms]
        saved = [str(parse_arm(a)) for a in state["arms"]]
        if saved != names:
            raise ValueError(
                f"the checkpoint's bandit arms {saved} differ from the configured arms {names}; "
                "configure the same arms to resume, or start the bandit afresh"
            )
        idx = {n: i for i, n in enumerate(names)}
        r = state["rng"]
        self._rng.bit_generator.state = dict(
            bit_generator="PCG64",
            state=dict(state=int(r["state"]), inc=int(r["inc"])),
            has_uint32=int(r["has_uint32"]),
            uinteger=int(r["uinteger"]),
        )
        self._order, self._rates, self._median_cache = {}, {}, {}
        for b, window in state["observations"].items():
            for a, v in window:
                self._append(int(b), idx[a], float(v))
        self._tokens = np.asarray(state["tokens"], np.int64).reshape(len(names))
        self._seconds = np.asarray(state["seconds"], np.float64).reshape(len(names))
        self._steps = {int(b): {idx[a]: int(s) for a, s in per.items()} for b, per in state["steps"].items()}
        self._choices = {int(b): {k: int(v) for k, v in c.items()} for b, c in state["choices"].items()}
        self._best = {int(b): idx[a] for b, a in state["best"].items()}
        self._best_changes = {int(b): int(n) for b, n in state["best_changes"].items()}

    @classmethod
    def from_state_dict(cls, config: BanditConfig, state: Mapping[str, Any]) -> Bandit:
        bandit = cls(config)
        bandit.load_state_dict(state)
        return bandit


def make_bandit(arms: Iterable[str | Arm] | str, **kwargs) -> Bandit:
    """Shorthand: ``make_bandit(["off", "eagle:8x4x48"], epsilon=0.1, window=300, seed=0)``."""
    return Bandit(BanditConfig(tuple(parse_arms(arms)), **kwargs))
