"""The rollout as the learner sees it when the mesh is sliced or the drafter trains online (TLT's adaptive drafter).

``ControlledRollout`` has the engine surface the learner uses (``set_params``, ``params``, ``generate``): after
``begin(step)`` the next ``generate`` is that step's training rollout, run by the Controller (slices, drafter steps
on idle slices, timeline); any other ``generate`` (evaluation) is a plain sliced rollout with no training. After the
training rollout the averaged drafter goes to every slice's engine, so the next rollout drafts with it. The drafter's
train state and the data buffer are saved with the checkpoint and restored exactly on resume.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from tlt_jax.controller.controller import Controller
from tlt_jax.controller.scheduler import ControllerConfig
from tlt_jax.controller.slices import SlicedRollout
from tlt_jax.drafter.buffer import BufferSample, DrafterBuffer
from tlt_jax.drafter.spot import HELDOUT, SpotTrainer
from tlt_jax.rollout import RolloutResult, SamplingParams

log = logging.getLogger("tlt_jax")

BUFFER_DIR = "drafter_buffer"
EXPORT_DIR = "drafter_eagle"


class ControlledRollout:
    """Learner-facing rollout over ``rollout``'s slices, driven by ``controller`` (trainer / buffer optional)."""

    def __init__(self, rollout: SlicedRollout, controller: Controller):
        self.rollout, self.controller = rollout, controller
        self.trainer: SpotTrainer | None = controller.trainer
        self.buffer: DrafterBuffer | None = controller.buffer
        self._step: int | None = None
        self._metrics: dict[str, float] = {}

    # ---- the engine surface the learner uses -----------------------------------------------------------------

    @property
    def params(self):
        return [e.params for e in self.rollout.engines.values()]

    def set_params(self, model) -> None:
        self.rollout.set_params(model)

    @property
    def bandit(self):
        """This process's first slice's adaptive bandit (None when the rollout is not adaptive); every slice has its
        own."""
        return self.rollout.engines[self.rollout.local_slices[0]].bandit

    def state_dict(self) -> dict:
        """Every slice engine's host state (adaptive: its bandit) in slice order, for the checkpoint; across
        processes gathered from every process (a collective)."""
        if self.bandit is None:
            return {}
        mine = {str(s): e.state_dict() for s, e in self.rollout.engines.items()}
        if self.rollout.across_processes:
            from tlt_jax.distributed.multihost import allgather_objects

            mine = {s: st for part in allgather_objects(mine) for s, st in part.items()}
        return {"slices": [mine[str(s)] for s in range(self.rollout.num_slices)]}

    def history_state(self) -> dict | None:
        """Every slice engine's n-gram history (``RolloutEngine.history_state``) in slice order, None without one;
        across processes gathered from every process (a collective)."""
        if self.rollout.engines[self.rollout.local_slices[0]].ngram_history is None:
            return None
        mine = {str(s): e.history_state() for s, e in self.rollout.engines.items()}
        if self.rollout.across_processes:
            from tlt_jax.distributed.multihost import allgather_objects

            mine = {s: st for part in allgather_objects(mine) for s, st in part.items()}
        return {"slices": [mine[str(s)] for s in range(self.rollout.num_slices)]}

    def load_history_state(self, state: dict | None) -> None:
        """Restore ``history_state()`` output (None: nothing saved, the stores stay empty)."""
        if state is None:
            return
        if len(state["slices"]) != self.rollout.num_slices:
            raise ValueError(f"the checkpoint holds {len(state['slices'])} slice engines' n-gram histories, this run "
                             f"has {self.rollout.num_slices} (rollout.num_slices must match to resume them)")
        for s, e in self.rollout.engines.items():
            e.load_history_state(state["slices"][s])

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output: one engine state per slice, in slice order."""
        saved = state.get("slices")
        if saved is None:
            raise ValueError("the saved engine state is not a sliced rollout's; it was saved with another "
                             "rollout.num_slices or without online drafter training")
        if len(saved) != self.rollout.num_slices:
            raise ValueError(f"the checkpoint holds {len(saved)} slice engines' state, this run has "
                             f"{self.rollout.num_slices} (rollout.num_slices must match to resume the bandits)")
        for s, e in self.rollout.engines.items():
            e.load_state_dict(saved[s])

    def begin(self, step: int) -> None:
        """The next generate call is RL step ``step``'s rollout (controller-driven, drafter training)."""
        self._step, self._metrics = int(step), {}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, request_ids=None,
                 on_chunk=None) -> RolloutResult:
        if self._step is None:
            return self.rollout.generate(prompts, params, request_ids=request_ids, on_chunk=on_chunk)
        step, self._step = self._step, None
        res, m = self.controller.run_step(step, prompts, params, request_ids=request_ids, on_chunk=on_chunk)
        self._metrics = m
        if self.trainer is not None:
            t = time.perf_counter()
            self.publish_drafter()  # the averaged copies, where they lie
            m.setdefault("drafter/loss", float("nan"))
            m.setdefault("drafter/step_s", float("nan"))
            m["drafter/train_top1"] = m.pop("drafter/top1", float("nan"))
            # Top-1 agreement with the policy of the drafter that drafted this rollout, on the step's own responses
            # (which it never trained on): evaluated during the rollout by a slice that had finished (Controller).
            m["drafter/top1"] = m.pop(HELDOUT, float("nan"))
            # What drafter work added to the RL step: from the last shard's end, the drafter steps still in flight, the
            # replicas' average and publishing (not the exchange of the rollout's results between processes, which is
            # the rollout's).
            m["drafter/critical_s"] = self.controller.drafter_critical_s + time.perf_counter() - t
        return res

    @property
    def metrics(self) -> dict[str, float]:
        """The last training rollout's metrics (with a drafter, its figures too)."""
        return self._metrics

    def compile(self) -> None:
        """Compile every slice's drafter step and held-out evaluation before the first RL step, so no compile lands on
        an RL step's critical path (the first drafter step of a slice may be the one in flight when the rollout
        ends)."""
        cfg = self.controller.cfg
        self.trainer.compile(cfg.rows, cfg.row_len)

    def publish_drafter(self) -> None:
        """The trainer's current drafter to every slice's engine (used from the next generate on), each from the copy
        already on that slice's devices."""
        for s, engine in self.rollout.engines.items():
            engine.set_drafter_params(self.trainer.params_on(s))

    def close(self) -> None:
        self.rollout.close()

    # ---- checkpoint state -----------------------------------------------------------------------------------

    def buffer_dir(self, workdir: str) -> str:
        """workdir/drafter_buffer; across processes each process's own buffer in workdir/drafter_buffer/process_I."""
        if not self.rollout.across_processes:
            return os.path.join(workdir, BUFFER_DIR)
        import jax

        return os.path.join(workdir, BUFFER_DIR, f"process_{jax.process_index()}")

    def save_buffer(self, workdir: str, step: int, keep: int) -> None:
        """The buffer's samples and counters at ``step`` to ``buffer_dir``/step_N.npz (newest ``keep``)."""
        if self.buffer is None:
            return
        d = self.buffer_dir(workdir)
        os.makedirs(d, exist_ok=True)
        b, samples = self.buffer, list(self.buffer.samples)
        h = samples[0].hidden.shape[1] if samples else 0
        np.savez(
            os.path.join(d, f"step_{step}.tmp.npz"),
            steps=np.array([s.step for s in samples], np.int64),
            lengths=np.array([s.ids.size for s in samples], np.int64),
            response_starts=np.array([s.response_start for s in samples], np.int64),
            ids=np.concatenate([s.ids for s in samples]) if samples else np.zeros(0, np.int32),
            hidden=np.concatenate([s.hidden for s in samples]) if samples else np.zeros((0, h), np.float32),
            counters=np.array([-1 if b.step is None else b.step, b.dropped, b.expired, b.skipped], np.int64),
        )
        os.replace(os.path.join(d, f"step_{step}.tmp.npz"), os.path.join(d, f"step_{step}.npz"))
        old = sorted(int(f[5:-4]) for f in os.listdir(d) if f.startswith("step_") and f[5:-4].isdigit())
        for s in old[:-keep]:
            os.remove(os.path.join(d, f"step_{s}.npz"))

    def load_buffer(self, workdir: str, step: int) -> bool:
        """Restore the buffer saved at ``step``; False (buffer left empty) when there is no such file."""
        path = os.path.join(self.buffer_dir(workdir), f"step_{step}.npz")
        if self.buffer is None or not os.path.exists(path):
            return False
        with np.load(path) as z:
            b = self.buffer
            b.samples.clear()
            b.nbytes = 0
            ends = np.cumsum(z["lengths"])
            # Files written before prompt context was kept have no response_starts: every window began at the prompt's
            # last position.
            starts = z["response_starts"] if "response_starts" in z.files else np.ones_like(ends)
            for st, lo, hi, rs in zip(z["steps"], ends - z["lengths"], ends, starts, strict=True):
                sample = BufferSample(int(st), z["ids"][lo:hi], z["hidden"][lo:hi], int(rs))
                b.samples.append(sample)
                b.nbytes += sample.nbytes
            cur, b.dropped, b.expired, b.skipped = (int(x) for x in z["counters"])
            b.step = None if cur < 0 else cur
        return True


def build_controlled(cfg, model, mesh, engine_kwargs: dict, workdir: str | None):
    """``rollout.num_slices`` engines on disjoint tensor-parallel groups of the mesh, driven by the Controller (which
    writes workdir/timeline.jsonl); with ``drafter.online`` also the drafter buffer and spot trainer, the engines
    capturing the last ``drafter.window`` hidden states of every response (and up to ``drafter.prompt_context``
    positions of its prompt before a response that fits the window)."""

    from tlt_jax.config import ConfigError
    from tlt_jax.drafter.train import DrafterOptimConfig

    r, d = cfg.rollout, cfg.drafter
    try:
        rollout = SlicedRollout(model, mesh, r.num_slices, **engine_kwargs)
    except ValueError as e:
        raise ConfigError(f"config.rollout.num_slices: {e}") from e
    ccfg = ControllerConfig(train_drafter=d.online, row_len=d.row_len, rows=d.rows, hot_swap=d.hot_swap,
                            steps_without_idle=d.resolved_steps_without_idle(rollout.num_slices))
    trainer = buffer = None
    if d.online:
        trainer = SpotTrainer(engine_kwargs["drafter"], {s: rollout.meshes[s] for s in rollout.local_slices},
                              rollout.policy, optim=DrafterOptimConfig(learning_rate=d.lr), seed=cfg.train.seed,
                              across_processes=rollout.across_processes, activity=rollout.activity,
                              all_meshes=rollout.meshes)
        need = max(trainer.batch_multiple)
        if d.rows % need:
            rollout.close()
            raise ConfigError(
                f"config.drafter.rows: {d.rows} does not split over a slice's {need} batch-parallel devices; set "
                f"--config.drafter.rows to a multiple of {need}"
            )
        buffer = DrafterBuffer(d.buffer_bytes, keep_steps=2)
    ctl = ControlledRollout(rollout, Controller(rollout, trainer=trainer, buffer=buffer, cfg=ccfg, workdir=workdir))
    if trainer is not None:
        ctl.compile()
    return ctl


class OnlineState:
    """The main loop's view of a ControlledRollout (sliced rollout / online drafter); inert for a plain engine."""

    def __init__(self, engine, mesh, workdir: str, primary: bool):
        self.engine = engine
        self.ctl = engine if isinstance(engine, ControlledRollout) else None
        self.trainer = None if self.ctl is None else self.ctl.trainer
        self.mesh, self.workdir, self.primary = mesh, workdir, primary

    def begin(self, step: int) -> None:
        if self.ctl is not None:
            self.ctl.begin(step)

    def metrics(self) -> dict[str, float]:
        return {} if self.ctl is None else dict(self.ctl.metrics)

    def extra(self) -> dict | None:
        """Checkpoint items: the drafter's trainable params + optimizer state, replicated over the mesh."""
        if self.trainer is None:
            return None
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return {"drafter": jax.device_put(self.trainer.state_tree(), NamedSharding(self.mesh, PartitionSpec()))}

    def abstract_extra(self) -> dict | None:
        from tlt_jax.checkpoint import abstract_like

        extra = self.extra()
        return None if extra is None else {k: abstract_like(v) for k, v in extra.items()}

    def save(self, step: int, keep: int) -> None:
        """The drafter buffer (process 0's; across processes every process's own)."""
        if self.ctl is not None and (self.primary or self.ctl.rollout.across_processes):
            self.ctl.save_buffer(self.workdir, step, keep)

    def restore(self, step: int, extra: dict) -> None:
        """The drafter state and data buffer of the checkpoint at ``step``; the engines draft with that drafter."""
        if self.trainer is None:
            return
        import jax

        self.trainer.load_state_tree(jax.tree.map(lambda x: np.asarray(jax.device_get(x)), extra["drafter"]))
        self.ctl.publish_drafter()
        if not self.ctl.load_buffer(self.workdir, step):
            log.warning("no drafter buffer saved at step %d: drafter training restarts from an empty buffer", step)

    def export(self) -> str | None:
        """End of run: the adapted drafter in the EAGLE layout under workdir/drafter_eagle (process 0)."""
        if self.trainer is None or not self.primary:
            return None
        path = os.path.join(self.workdir, EXPORT_DIR)
        self.trainer.export(path)
        return path

    def close(self) -> None:
        """Stop the rollout's threads (slice workers, background compiles)."""
        self.engine.close()
