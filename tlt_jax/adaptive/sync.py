"""Multi-process agreement for the bandit: every process must choose the same arm, or the SPMD steps diverge.

Chosen path: reduce the timings, not broadcast the choice. The tokens a round trip emitted come from the replicated
info array, so they already agree; only the host clock differs between processes. ``agreed_seconds`` replaces each
process's measurement by the maximum over processes (an SPMD step takes as long as its slowest process), so every
process feeds its own bandit (same config, same seed) the same numbers in the same order, and every bandit holds the
same state: the same choices follow without a second collective, and any process's state is the checkpoint. In one
process it is the identity and touches no collective.

Background compiles (``tlt_jax.rollout.pool.StepPool.prepare``) finish at different times in different processes, so
whether a speculative arm's step is ready, and whether a round trip overlapped a compile, are agreed the same way
(``agreed_all``: true only where true on every process).
"""

from __future__ import annotations

import numpy as np


def agreed_seconds(*seconds: float, across: bool = True) -> float | tuple[float, ...]:
    """The maximum of each of ``seconds`` over all JAX processes (as float32, so every process gets the same bits;
    one collective for all of them, none in one process): a float for one value, else a tuple. across=False: an
    engine on this process's devices alone (a rollout slice), whose bandit no other process runs: no collective."""
    import jax  # here, not at import: the config (which reads the arms) loads without JAX

    if not across or jax.process_count() == 1:
        out = tuple(float(s) for s in seconds)
    else:
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(np.asarray(seconds, np.float32))
        out = tuple(float(v) for v in np.asarray(gathered).reshape(-1, len(seconds)).max(axis=0))
    return out[0] if len(out) == 1 else out


def agreed_all(*flags: bool, across: bool = True) -> tuple[bool, ...]:
    """Each flag AND-ed over all JAX processes (one collective for all of them; none in one process or with
    across=False, as ``agreed_seconds``)."""
    import jax

    if not across or jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return tuple(bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).min(axis=0))
