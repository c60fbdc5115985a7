"""BEG-MAB: a bucketed epsilon-greedy bandit choosing the speculation arm for each batch-size bucket.

One bandit per batch bucket (the engine's compiled batch buckets; a ``table`` may restrict a bucket to some arms). The
engine reports every host round trip as (arm, bucket, tokens, seconds, steps, live rows averaged over its steps, the
lagging row's tokens). The reward is a row's progress per second: by default tokens/s per live row (a bucket's compiled
step costs the same whatever its live rows, so per row the arms compare alike early and late in a wave, and a row
finishing mid-trip counts only for the steps it ran); with ``lag`` given, the tokens/s of the wave's lagging row (the
live row with the most budget left). Plain decoding advances every live row alike, so both agree there; speculation
advances rows unevenly, and a wave whose rows run to a shared cap ends when its lagging row does, so the mean row
overstates what speculation buys (measured in ``benchmarks/README.md``). The engine leaves one-off costs out: an EAGLE
round trip's drafter catch-up over pairs other arms recorded is timed apart, and the round trip that runs a compiled
step for the first time is not reported (``tlt_jax.rollout.run``). Each bucket keeps its last ``window`` observations
over all its arms; an arm's estimate there is the median reward of its observations in the window, or, if it has none,
an estimate transferred from the nearest bucket that measured it together with an arm this bucket measured (relative
speed carries over, absolute speed does not; ``tlt_jax.adaptive.estimates``). Choosing an arm for a bucket:

1. arms of which nothing is known (no estimate, measured or transferred), or that the bucket's window holds fewer
   than ``min_count`` measurements of, are tried first (the least measured first, ties in the configured order, so
   every arm is measured once before any twice): a median of one or two round trips may be one slow stretch of the
   machine (a compile beside it, the first call of a run), and an arm it ruled out would not be explored again until
   that measurement left the window;
2. otherwise the best estimate is exploited, except that with probability ``epsilon`` an exploration draw picks one of
   the *plausible* other arms: those not clearly worse than the best, i.e. whose estimate is at least ``(1 - margin)``
   times the best's once the noise of few observations is allowed for (``margin=1``: every arm, as the original
   BEG-MAB; an estimate transferred from d octaves away must reach ``(1 - margin)^(1 + d)``; see ``_plausible``).
   With ``time_share`` the draw is kept with probability min(1, best's round-trip seconds / the drawn arm's), so
   exploration takes at most about ``epsilon`` of the bucket's *time* even when the explored arm's round trips are
   longer than the best arm's (a verify round trip at a large batch).

A clearly losing arm is therefore not explored; it is measured again once fewer than ``min_count`` of its
observations are left in the bucket's window (about ``min_count / window`` of the bucket's round trips per losing
arm; with ``min_count=1``, once none is left and no fresh neighbour speaks for it): after the best arm changes (a
drafter that improved, a different temperature) every stale estimate is gone within about ``window`` observations.
Randomness comes from a seeded PCG64 generator drawn only at step 2, so the decisions are a function of the seed and
the reported numbers; in several processes every process must report the same numbers
(``tlt_jax.adaptive.sync.agreed_seconds``).

With ``max_loss`` the bandit is a *conservative* bandit (after Wu et al., "Conservative Bandits", ICML 2016) with
plain decoding as the baseline: a ledger (``charge``) holds what every round trip the bandit decided would have
taken with plain decoding (tokens of the wave's lagging row over "off"'s estimate in the bucket; a quiet "off" round
trip counts as its own time) and the seconds it took, observed or not: first runs of a step, round trips beside a
background compile, an EAGLE drafter's catch-up, a speculative step's compile in place. While the loss (seconds
taken minus plain's) is at least ``max_loss`` times plain's seconds, the bandit explores nothing that may lose:
arms not yet measured enough and exploration draws give way to "off" (counted as ``held``), and the engine starts no
compile (``may_spend``); the best estimate is still exploited, and so is a try expected to gain even read
pessimistically (an arm's own median above "off"'s by more than the noise of so few observations allows; counted as
``safe``): an arm measured once at twice plain's speed is measured again and, if it holds, exploited. "off" is
measured first in every bucket, as the baseline.
Exploration therefore pays for itself, from what speculation gained or from ``max_loss`` of the time decoded
plainly: the loss exceeds the bound by at most what one round trip or one compile costs beyond it, unless exploiting
the best estimate or a safe try itself loses (a wrong median; the ledger shows it, and the window corrects it).

The state (observations, generator, counters, ledger) round-trips through ``state_dict`` / ``load_state_dict`` as
JSON values, so it lives in checkpoints and carries across generate calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tlt_jax.adaptive.arms import Arm, parse_arm, parse_arms
from tlt_jax.adaptive.config import OFF, BanditConfig
from tlt_jax.adaptive.estimates import Estimate, Windows

STATE_VERSION = 2
__all__ = ["OFF", "STATE_VERSION", "Bandit", "BanditConfig", "make_bandit"]


class Bandit:
    """The per-bucket epsilon-greedy bandit over ``config.arms``. ``choose(bucket)`` → Arm; ``observe(arm, bucket,
    tokens, seconds, steps, rows)`` after each round trip that ran the arm; ``estimates(bucket)`` what a choice sees;
    ``stats()`` for the metrics."""

    NOISE_Z = 2.0  # standard errors of allowance in ``_plausible``

    def __init__(self, config: BanditConfig):
        self.config = config
        self._index = {a: i for i, a in enumerate(config.arms)}
        self._rng = np.random.Generator(np.random.PCG64(config.seed))
        self._windows = Windows(config.window, len(config.arms))
        self._tokens = np.zeros(len(config.arms), np.int64)
        self._seconds = np.zeros(len(config.arms), np.float64)
        self._steps: dict[int, dict[int, int]] = {}
        # bucket -> counts: untried + explore + exploit + held = choices (held: the loss budget turned a try or an
        # exploration into "off" or the best arm); declined (exploration draws that exploited: no plausible arm, or
        # the time share said no) and transferred (exploited an estimate from another bucket) are parts of exploit;
        # safe (tries and explorations a spent budget let through, ``_safe``) is part of untried + explore
        self._choices: dict[int, dict[str, int]] = {}
        self._best: dict[int, int] = {}
        self._best_changes: dict[int, int] = {}
        # the ledger (``charge``): plain decoding's seconds for the charged round trips, and their seconds minus that
        self._plain_s = 0.0
        self._loss_s = 0.0

    # ---- decisions ------------------------------------------------------------------------------------------

    def choose(self, bucket: int) -> Arm:
        """The arm to run next in this batch bucket (see the module docstring for the rule)."""
        bucket = self._bucket(bucket)
        arms = self.config.arms_for(bucket)
        counts = self._choices.setdefault(bucket, _counts())
        if len(arms) == 1:
            counts["exploit"] += 1
            return arms[0]
        est = self._estimates(bucket, arms)
        short = [
            (0 if e is None else e.count, k, a)
            for k, a in enumerate(arms)
            if (e := est.get(self._index[a])) is None or (not e.transferred and e.count < self.config.min_count)
        ]
        conservative = self.config.max_loss is not None and OFF in arms
        held = conservative and not self.may_spend()
        if short:  # the least measured first, then in the configured order (conservative: the baseline first)
            if conservative and any(a == OFF for *_, a in short):
                counts["untried"] += 1
                return OFF
            if held:  # only tries expected to gain (``_safe``) go on
                short = [s for s in short if self._safe(est.get(self._index[s[2]]), est.get(self._index[OFF]))]
                if not short:
                    counts["held"] += 1
                    return OFF
                counts["safe"] += 1
            counts["untried"] += 1
            return min(short)[2]
        best = self._argmax(arms, est)
        eb = est[self._index[best]]
        u = self._rng.random()
        if u < self.config.epsilon:
            plausible = [a for a in arms if a != best and self._plausible(est[self._index[a]], eb)]
            if plausible:
                pick = plausible[int(self._rng.integers(len(plausible)))]
                keep = 1.0
                ep = est[self._index[pick]]
                if self.config.time_share and eb.seconds > 0 and ep.seconds > 0:
                    keep = min(1.0, eb.seconds / ep.seconds)
                if u < self.config.epsilon * keep and held and not self._safe(ep, est.get(self._index[OFF])):
                    counts["held"] += 1
                    return best
                if u < self.config.epsilon * keep:
                    counts["explore"] += 1
                    counts["safe"] += int(held)
                    return pick
            counts["declined"] += 1
        counts["exploit"] += 1
        counts["transferred"] += int(eb.transferred)
        return best

    def observe(
        self,
        arm: Arm | str,
        bucket: int,
        tokens: int,
        seconds: float,
        steps: int = 1,
        rows: float = 1.0,
        lag: float | None = None,
    ) -> None:
        """Record one round trip of ``arm`` in ``bucket``: ``tokens`` emitted in ``seconds`` over ``steps`` decode or
        verify steps, ``rows`` live rows on average over those steps (the live row-steps / steps; a row that finishes
        mid-trip counts for the steps it ran). The reward is tokens/s per live row, or with ``lag`` (the tokens the
        round trip emitted for the wave's lagging row) lag / seconds (see the module docstring)."""
        arm, bucket = parse_arm(arm), self._bucket(bucket)
        if arm not in self._index:
            raise ValueError(
                f"observe: arm '{arm}' is not one of the bandit's arms {[str(a) for a in self.config.arms]}"
            )
        if int(tokens) != tokens or tokens < 0:
            raise ValueError(f"observe: tokens must be an integer >= 0, got {tokens}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"observe: steps must be an integer >= 0, got {steps}")
        if not np.isfinite(rows) or not 0 < rows <= bucket:
            raise ValueError(
                f"observe: rows must be the mean live rows over the round trip's steps, in (0, {bucket}], got {rows}"
            )
        if not np.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"observe: seconds must be a finite time > 0, got {seconds} (time the round trip itself)")
        if lag is not None and (not np.isfinite(lag) or lag < 0):
            raise ValueError(f"observe: lag must be the lagging row's tokens in the round trip (>= 0), got {lag}")
        i = self._index[arm]
        reward = float(tokens) / float(rows) if lag is None else float(lag)
        self._windows.add(bucket, i, reward / float(seconds), float(seconds))
        self._tokens[i] += int(tokens)
        self._seconds[i] += float(seconds)
        per = self._steps.setdefault(bucket, {})
        per[i] = per.get(i, 0) + int(steps)
        self._track_best(bucket)

    def charge(
        self,
        arm: Arm | str,
        bucket: int,
        tokens: int,
        seconds: float,
        rows: float = 1.0,
        lag: float | None = None,
        as_plain: bool = True,
    ) -> None:
        """Enter one round trip the bandit decided in the ledger, whether ``observe`` saw it or not. Plain decoding's
        seconds for it: its own for an "off" round trip that cost what plain decoding costs anyway (``as_plain``: no
        compile beside it; a plain step's first run is plain decoding's cost too); otherwise its progress (``lag``,
        or tokens / rows, as in ``observe``) over "off"'s estimate in the bucket, or its own seconds where the bucket
        has none yet. ``seconds``: all it took (a drafter's catch-up included)."""
        arm, bucket = parse_arm(arm), self._bucket(bucket)
        if not np.isfinite(seconds) or seconds < 0:
            raise ValueError(f"charge: seconds must be a finite time >= 0, got {seconds}")
        plain = float(seconds)
        if not (arm == OFF and as_plain) and OFF in self._index and self._windows.measured(bucket):
            e = self._estimates(bucket, [OFF]).get(self._index[OFF])
            if e is not None and e.rate > 0:
                plain = (float(tokens) / float(rows) if lag is None else float(lag)) / e.rate
        self._plain_s += plain
        self._loss_s += float(seconds) - plain

    def headroom(self) -> float:
        """Seconds exploration may still cost: ``max_loss`` x plain's seconds - the loss so far (inf without
        max_loss)."""
        if self.config.max_loss is None:
            return math.inf
        return self.config.max_loss * self._plain_s - self._loss_s

    def may_spend(self) -> bool:
        """Whether exploring, or compiling a step for an arm, fits the loss budget (always without max_loss)."""
        return self.headroom() > 0

    def best(self, bucket: int) -> Arm | None:
        """The arm with the highest median reward measured in the bucket's window (None before any observation)."""
        bucket = self._bucket(bucket)
        med = self._windows.measured(bucket)
        arms = [a for a in self.config.arms_for(bucket) if self._index[a] in med]
        return self._argmax(arms, med) if arms else None

    def medians(self, bucket: int) -> dict[Arm, float]:
        """Median reward (a row's tokens/s) per arm over the bucket's window (arms with observations only)."""
        med = self._windows.measured(self._bucket(bucket))
        return {self.config.arms[i]: e.rate for i, e in sorted(med.items())}

    def estimates(self, bucket: int) -> dict[Arm, Estimate]:
        """What ``choose`` sees in the bucket: per arm of the bucket with anything known, its measured or transferred
        estimate (``Estimate.source`` names the bucket it comes from)."""
        bucket = self._bucket(bucket)
        est = self._estimates(bucket, self.config.arms_for(bucket))
        return {self.config.arms[i]: e for i, e in sorted(est.items())}

    def _estimates(self, bucket: int, arms: Sequence[Arm]) -> dict[int, Estimate]:
        return self._windows.estimates(bucket, [self._index[a] for a in arms], self.config.transfer)

    def _plausible(self, e: Estimate, best: Estimate) -> bool:
        """Not clearly worse than the best: ln(best / e) <= -ln(1 - margin) * (1 + distance) + 2 * noise *
        sqrt(1/n_e + 1/n_best). A transferred estimate (distance in octaves of batch size) is an extrapolation, so its
        margin compounds once per octave; a median of few observations may be off by their noise, so an arm is not
        ruled out on one unlucky round trip."""
        if self.config.margin >= 1.0 or e.rate >= best.rate:
            return True
        if e.rate <= 0:
            return False
        slack = -math.log1p(-self.config.margin) * (1.0 + e.distance)
        slack += self.NOISE_Z * self._windows.noise() * math.sqrt(1.0 / max(e.count, 1) + 1.0 / max(best.count, 1))
        return math.log(best.rate / e.rate) <= slack

    def _safe(self, e: Estimate | None, off: Estimate | None) -> bool:
        """Whether a try of an arm is expected to gain against plain decoding even read pessimistically: its own
        median in the bucket beats "off"'s by more than NOISE_Z standard errors (ln(e / off) > NOISE_Z * noise *
        sqrt(1/n_e + 1/n_off)). Such a try needs no loss budget, so a spent budget does not hold it (``safe``);
        transferred estimates, and any estimate before the noise is known, never qualify."""
        if e is None or off is None or e.transferred or off.transferred or min(e.rate, off.rate) <= 0:
            return False
        noise = self._windows.noise()
        if noise <= 0:
            return False
        return math.log(e.rate / off.rate) > self.NOISE_Z * noise * math.sqrt(1.0 / e.count + 1.0 / off.count)

    def _argmax(self, arms: Sequence[Arm], est: Mapping[int, Estimate]) -> Arm:
        return max(arms, key=lambda a: (est[self._index[a]].rate, -self._index[a]))

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
        median_reward: {bucket: {arm: window median of a row's tokens/s}}; best: {bucket: arm}; choices:
        {bucket: {untried, explore, exploit, declined, transferred, held, safe}}; best_changes: {bucket: times the best
        arm changed}; transferred: {bucket: {arm: the bucket its estimate comes from}} for arms known there only by
        transfer; ledger: {plain_s, loss_s, max_loss} (``charge``). Arms as strings."""
        names = [str(a) for a in self.config.arms]
        buckets = sorted(self._windows.obs)
        transferred = {}
        for b in buckets:
            t = {str(a): e.source for a, e in self.estimates(b).items() if e.transferred}
            if t:
                transferred[b] = t
        return dict(
            steps={b: {names[i]: s for i, s in sorted(per.items())} for b, per in sorted(self._steps.items())},
            tokens_per_s={
                names[i]: float(self._tokens[i] / self._seconds[i]) for i in range(len(names)) if self._seconds[i] > 0
            },
            median_reward={b: {str(a): v for a, v in self.medians(b).items()} for b in buckets},
            best={b: names[i] for b, i in sorted(self._best.items())},
            choices={b: dict(c) for b, c in sorted(self._choices.items())},
            best_changes=dict(sorted(self._best_changes.items())),
            transferred=transferred,
            ledger=dict(plain_s=self._plain_s, loss_s=self._loss_s, max_loss=self.config.max_loss),
        )

    # ---- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (bucket keys as strings, the generator's 128-bit words as decimal strings;
        observations as [arm, reward, seconds, sequence number], oldest first)."""
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
            seq=self._windows.seq,
            observations={
                str(b): [[names[i], r, s, q] for i, r, s, q in self._windows.entries(b)]
                for b in sorted(self._windows.obs)
            },
            tokens=self._tokens.tolist(),
            seconds=self._seconds.tolist(),
            steps={str(b): {names[i]: s for i, s in per.items()} for b, per in sorted(self._steps.items())},
            choices={str(b): dict(c) for b, c in sorted(self._choices.items())},
            best={str(b): names[i] for b, i in sorted(self._best.items())},
            best_changes={str(b): n for b, n in sorted(self._best_changes.items())},
            ledger=[self._plain_s, self._loss_s],
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (version 1 states, which kept no round-trip seconds, load too: their
        observations count as measured in order, with unknown times). The saved arms must be the configured arms
        (same order): a checkpoint of another arm set would mis-assign the counters. A smaller window keeps each
        bucket's newest observations."""
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(
                f"bandit state version {version!r} is not {STATE_VERSION} (or 1); it is from another tlt_jax version"
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
        self._windows = Windows(self.config.window, len(self.config.arms))
        for b, window in state["observations"].items():
            for obs in window:
                if version == 1:
                    self._windows.add(int(b), idx[obs[0]], float(obs[1]), 0.0)
                else:
                    a, rate, secs, seq = obs
                    self._windows.add(int(b), idx[a], float(rate), float(secs), int(seq))
        self._windows.seq = max(self._windows.seq, int(state.get("seq", 0)))
        self._tokens = np.asarray(state["tokens"], np.int64).reshape(len(names))
        self._seconds = np.asarray(state["seconds"], np.float64).reshape(len(names))
        self._steps = {int(b): {idx[a]: int(s) for a, s in per.items()} for b, per in state["steps"].items()}
        self._choices = {int(b): _counts(**{k: int(v) for k, v in c.items()}) for b, c in state["choices"].items()}
        self._best = {int(b): idx[a] for b, a in state["best"].items()}
        self._best_changes = {int(b): int(n) for b, n in state["best_changes"].items()}
        self._plain_s, self._loss_s = (float(v) for v in state.get("ledger", (0.0, 0.0)))  # none before max_loss

    @classmethod
    def from_state_dict(cls, config: BanditConfig, state: Mapping[str, Any]) -> Bandit:
        bandit = cls(config)
        bandit.load_state_dict(state)
        return bandit


def _counts(**kw: int) -> dict[str, int]:
    return dict(dict(untried=0, explore=0, exploit=0, declined=0, transferred=0, held=0, safe=0), **kw)


def make_bandit(arms: Iterable[str | Arm] | str, **kwargs) -> Bandit:
    """Shorthand: ``make_bandit(["off", "eagle:8x4x48"], epsilon=0.1, window=300, seed=0)``."""
    return Bandit(BanditConfig(tuple(parse_arms(arms)), **kwargs))
