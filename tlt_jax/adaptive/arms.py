"""Speculation arms: ``"off"`` (plain K-step decoding) or a drafter with a tree shape, ``"ngram:DxKxN"`` /
``"eagle:DxKxN"`` (draft depth D, top-k K children per frontier node, N verify tokens incl. the root).

An arm is a hashable, ordered value: the bandit keys its statistics by it, the compiled-step pool by ``pool_name``
(the same name ``SpecConfig.arm`` gives the engine's verify steps), and it is written to checkpoints as ``str(arm)``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

DRAFTERS = ("ngram", "eagle")
_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def max_verify_tokens(depth: int, topk: int) -> int:
    """Largest tree an EAGLE-2 draft of this depth / top-k can fill: the root + topk + (depth-1)*topk^2 candidates
    (the bound ``SpecConfig`` enforces for both drafters)."""
    return 1 + topk + (depth - 1) * topk**2


@dataclasses.dataclass(frozen=True, order=True)
class Arm:
    """kind: "off" | "ngram" | "eagle"; depth / topk / verify_tokens: the tree shape (0 for "off")."""

    kind: str
    depth: int = 0
    topk: int = 0
    verify_tokens: int = 0

    def __post_init__(self):
        if self.kind == "off":
            if (self.depth, self.topk, self.verify_tokens) != (0, 0, 0):
                raise ValueError("arm 'off' has no tree shape; write it as just 'off'")
            return
        if self.kind not in DRAFTERS:
            raise ValueError(f"arm kind must be 'off', 'ngram' or 'eagle', got {self.kind!r}")
        for name in ("depth", "topk", "verify_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"arm {self.kind}: {name} must be an int, got {v!r}")
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"arm '{self}': depth and top-k must be >= 1")
        top = max_verify_tokens(self.depth, self.topk)
        if not 2 <= self.verify_tokens <= top:
            raise ValueError(
                f"arm '{self}': verify tokens N={self.verify_tokens} must be in [2, {top}] (N <= 1 + topk + "
                f"(depth-1)*topk^2 for depth={self.depth}, topk={self.topk}); lower N or raise depth / top-k"
            )

    @property
    def speculative(self) -> bool:
        return self.kind != "off"

    @property
    def pool_name(self) -> str:
        """The compiled-step pool's arm name: "plain" for off, else ``SpecConfig.arm(kind)``'s format."""
        if not self.speculative:
            return "plain"
        return f"tree/{self.kind}/d{self.depth}k{self.topk}n{self.verify_tokens}"

    @classmethod
    def from_spec(cls, kind: str, spec) -> Arm:
        """The arm of a drafter kind and a tree shape (anything with depth / topk / verify_tokens, e.g. a
        ``SpecConfig``; the engine's ``arm_spec`` goes the other way)."""
        return cls(kind, spec.depth, spec.topk, spec.verify_tokens)

    def __str__(self) -> str:
        if not self.speculative:
            return "off"
        return f"{self.kind}:{self.depth}x{self.topk}x{self.verify_tokens}"


def parse_arm(text: str | Arm) -> Arm:
    """``"off"``, ``"ngram:DxKxN"`` or ``"eagle:DxKxN"`` (e.g. "eagle:8x4x48") to an Arm; an Arm passes through."""
    if isinstance(text, Arm):
        return text
    if not isinstance(text, str):
        raise ValueError(f"an arm is a string like 'off' or 'eagle:8x4x48', got {type(text).__name__}")
    s = text.strip().lower()
    if s == "off":
        return Arm("off")
    kind, sep, shape = s.partition(":")
    if not sep or kind not in DRAFTERS:
        raise ValueError(f"arm {text!r}: expected 'off', 'ngram:DxKxN' or 'eagle:DxKxN' (e.g. 'eagle:8x4x48')")
    m = _SHAPE.match(shape)
    if m is None:
        raise ValueError(
            f"arm {text!r}: the tree shape must be DEPTHxTOPKxVERIFY_TOKENS, three positive integers like '8x4x48'"
        )
    return Arm(kind, *(int(g) for g in m.groups()))


def parse_arms(arms: Iterable[str | Arm] | str) -> tuple[Arm, ...]:
    """A non-empty list of distinct arms (a comma-separated string also works), in the given order."""
    if isinstance(arms, str):
        arms = [a for a in arms.split(",") if a.strip()]
    out = tuple(parse_arm(a) for a in arms)
    if not out:
        raise ValueError("the arm list is empty; give at least one arm, e.g. ['off', 'eagle:8x4x48']")
    seen: set[Arm] = set()
    for a in out:
        if a in seen:
            raise ValueError(f"arm '{a}' is listed twice; list each arm once")
        seen.add(a)
    return out
