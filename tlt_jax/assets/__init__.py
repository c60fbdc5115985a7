"""Files shipped inside the package: the warmed-up EAGLE drafter for the embedded SmolLM2 policy.

``rollout.drafter_path`` (and ``--drafter`` of the generate / benchmark commands) accept the name of a shipped
drafter as well as a directory, so an installed package finds it wherever it lives.
"""

from __future__ import annotations

import pathlib

__all__ = ["EMBEDDED_DRAFTER", "EMBEDDED_DRAFTERS", "resolve_drafter_path"]

_HERE = pathlib.Path(__file__).resolve().parent

# The committed warmed-up drafter of SmolLM2-135M-Instruct (fp32, draft vocabulary of 4,096 tokens), trained with
# `python -m tlt_jax.drafter.warmup` on 647 k of the policy's own greedy GSM-style response tokens; its record is
# eagle_smollm2_gsm/warmup.json and the recipe is in benchmarks/README.md.
EMBEDDED_DRAFTER = "eagle-smollm2-gsm"
EMBEDDED_DRAFTERS = {EMBEDDED_DRAFTER: _HERE / "eagle_smollm2_gsm"}


def resolve_drafter_path(path: str) -> str:
    """A shipped drafter's name -> its directory; anything else is returned unchanged (a directory path)."""
    return str(EMBEDDED_DRAFTERS[path]) if path in EMBEDDED_DRAFTERS else path
