"""The bandit's configuration (``BanditConfig``): its arms, exploration, windows, the per-bucket arm table and the
loss budget, validated with errors that name the field; and which (arm, batch bucket) pairs a rollout can reach, for
precompiling. The rule that uses it is ``tlt_jax.adaptive.bandit``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tlt_jax.adaptive.arms import Arm, parse_arms

OFF = Arm("off")


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """arms: the candidate arms (strings or Arms; "off" = plain decoding is an arm like any other). epsilon:
    exploration probability. window: observations per bucket the medians are taken over. seed: of the exploration
    generator. margin: explore only arms estimated within this fraction of the best (0 = only ties, 1 = every arm).
    transfer: estimate arms a bucket has not measured from the nearest bucket that did. time_share: epsilon bounds the
    share of time spent exploring, not of round trips. min_count: measurements of an arm a bucket's window must hold
    before its median decides (fewer: the arm is measured again first; 1 = one measurement suffices; at most
    window). max_loss: None, or the most time exploration and compiles may cost against plain decoding, as a
    fraction of plain's time (a conservative bandit; needs the "off" arm). table: optional {bucket: arms} restricting
    a batch bucket to a subset of ``arms`` (other buckets use all arms; a bucket with one arm never explores)."""

    arms: tuple[Arm, ...]
    epsilon: float = 0.1
    window: int = 300
    seed: int = 0
    table: tuple[tuple[int, tuple[Arm, ...]], ...] = ()
    margin: float = 0.1
    transfer: bool = True
    time_share: bool = True
    min_count: int = 3
    max_loss: float | None = None

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
        if isinstance(self.min_count, bool) or int(self.min_count) != self.min_count or self.min_count < 1:
            raise ValueError(
                f"BanditConfig.min_count must be an integer >= 1 (measurements of an arm before its median decides), "
                f"got {self.min_count!r}"
            )
        object.__setattr__(self, "min_count", min(int(self.min_count), int(self.window)))  # all a window can hold
        if isinstance(self.margin, bool) or not 0.0 <= float(self.margin) <= 1.0:
            raise ValueError(
                f"BanditConfig.margin must be in [0, 1], got {self.margin!r}: the fraction below the best arm's "
                "reward within which arms are still explored (e.g. 0.1; 1 explores every arm)"
            )
        if self.max_loss is not None:
            if isinstance(self.max_loss, bool) or not 0.0 < float(self.max_loss) <= 1.0:
                raise ValueError(
                    f"BanditConfig.max_loss must be None (no bound) or in (0, 1], got {self.max_loss!r}: the most time "
                    "exploration and compiles may cost against plain decoding, as a fraction of its time (e.g. 0.05)"
                )
            if OFF not in self.arms:
                raise ValueError(
                    "BanditConfig.max_loss bounds the loss against plain decoding, so arms must include 'off'; "
                    "add it, or set max_loss=None"
                )
        for name in ("transfer", "time_share"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BanditConfig.{name} must be True or False, got {getattr(self, name)!r}")

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
