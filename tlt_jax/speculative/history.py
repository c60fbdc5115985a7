"""Drafts from earlier rollouts: a bounded host store of the responses earlier ``generate`` calls gave each prompt.

In RL every prompt comes back each epoch with answers like the last ones (SPEC-RL, RhymeRL), so the n-gram drafter
merges a prompt's stored responses into its trie as extra sources beside the row's own context and its GRPO
siblings (``tlt_jax.rollout.run``). The store only proposes: verification stays lossless whatever it holds.

Entries are keyed by a 128-bit hash of the prompt's token ids; the bound is on the stored tokens' bytes (int32),
oldest response out first, and at most ``per_prompt`` responses per prompt (newest kept), which bounds the host's
trie work per row. ``state_dict`` / ``load_state_dict`` (JSON values: tokens as base64 int32) carry it through a
checkpoint.
"""

from __future__ import annotations

import base64
import collections
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

VERSION = 1


def prompt_key(prompt: Sequence[int]) -> str:
    """The store's key of a prompt: blake2b-128 of its token ids as int32 (hex)."""
    return hashlib.blake2b(np.asarray(prompt, np.int32).tobytes(), digest_size=16).hexdigest()


class NgramHistory:
    """Responses of earlier rollouts per prompt, at most ``max_bytes`` of tokens in all (oldest out) and
    ``per_prompt`` per prompt."""

    def __init__(self, max_bytes: int, per_prompt: int = 16):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if per_prompt < 1:
            raise ValueError(f"per_prompt must be >= 1, got {per_prompt}")
        self.max_bytes, self.per_prompt = int(max_bytes), int(per_prompt)
        self._entries: collections.OrderedDict[int, tuple[str, np.ndarray]] = collections.OrderedDict()
        self._by_key: dict[str, collections.deque[int]] = {}
        self._next_id, self.nbytes = 0, 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_prompts(self) -> int:
        return len(self._by_key)

    def _drop(self, entry_id: int) -> None:
        key, tokens = self._entries.pop(entry_id)
        ids = self._by_key[key]
        ids.remove(entry_id)  # the prompt's oldest in practice: O(1)
        if not ids:
            del self._by_key[key]
        self.nbytes -= tokens.nbytes

    def _put(self, key: str, tokens: np.ndarray) -> None:
        if tokens.size == 0 or tokens.nbytes > self.max_bytes:
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = (key, tokens)
        self._by_key.setdefault(key, collections.deque()).append(entry_id)
        self.nbytes += tokens.nbytes
        if len(self._by_key[key]) > self.per_prompt:
            self._drop(self._by_key[key][0])
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def add(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        """Store a prompt's responses (a GRPO group; empty ones skipped), evicting the oldest beyond the bounds."""
        key = prompt_key(prompt)
        for r in responses:
            self._put(key, np.asarray(r, np.int32).reshape(-1))

    def get(self, prompt: Sequence[int]) -> list[np.ndarray]:
        """The stored responses of ``prompt``, newest first (empty if none)."""
        ids = self._by_key.get(prompt_key(prompt), ())
        return [self._entries[i][1] for i in reversed(ids)]

    def clear(self) -> None:
        self._entries.clear()
        self._by_key.clear()
        self.nbytes = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON values: the bounds and every entry, oldest first, as ``[key, base64 of int32 tokens]``."""
        entries = [[k, base64.b64encode(t.astype("<i4").tobytes()).decode("ascii")] for k, t in self._entries.values()]
        return {"version": VERSION, "max_bytes": self.max_bytes, "per_prompt": self.per_prompt, "entries": entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output. The entries are re-added oldest first under this store's own bounds
        (a smaller ``max_bytes`` keeps the newest that fit)."""
        if state.get("version") != VERSION:
            raise ValueError(f"n-gram history state version {state.get('version')!r}, expected {VERSION}")
        self.clear()
        for key, data in state["entries"]:
            self._put(str(key), np.frombuffer(base64.b64decode(data), "<i4").astype(np.int32))
