"""The pod model on GPU-measured step costs, and its check against a measured GPU run (``pod_sim.py --gpu_costs``).

Input (``--gpu_costs=PATH``): a JSON file of milliseconds; batch keys are row counts as strings.

    {"source": "what measured these (machine, script, commit)",
     "device": "NVIDIA H200",               optional; names the Hardware of the calibrated projection (H100 / H200)
     "model": "Qwen2.5-7B",                 optional; a pod_sim_roofline ModelSpec name enables that projection
     "length": 4096,                        optional; the cache length the costs were measured at
     "decode_ms": {"1": 1.6, "64": 2.6},    required: one plain decode step, by batch
     "verify_ms": {"64": {"1": 2.0}},       the policy's verify pass over N tree tokens per row, by N, then batch
     "draft_ms": {"1": 0.3},                one drafter forward (one tree depth), by batch
     "spec_step_ms": {"5x1x6": {"1": 3.1}}, a whole speculative step of one tree (draft + verify + extend), by
                                            batch; where given it replaces verify_ms + depth x draft_ms
     "prefill_ms": {"64": 30.0},            optional: one prefill call, by batch (default 0)
     "roundtrip_ms": 0.0, "compact_ms": 0.0}  optional: per engine call / per compaction

``benchmarks/results/gpu/suite.json`` (``gpu_suite.py``) is read too: the rows of its ``decode`` section
({"batch", "tree_tokens", "ms"}) of one variant become decode_ms (one token) and verify_ms (a tree); ``gpu_tlt.py``
writes its own ``step_costs`` in this format (``--gpu_costs=RESULT#step_costs`` reads a key of a file).
Between measured batches (and tree sizes, decode being a tree of 1) a cost is linear; above the largest measured
batch it extends the last segment; below the smallest it is the smallest's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pod_sim_model as ps
import pod_sim_roofline as rf

TOLERANCE = 0.15  # the goal: the pod model within +-15 % of a measured GPU run


def _curve(points: dict) -> list[tuple[float, float]]:
    pts = sorted((float(k), float(v)) for k, v in points.items())
    if not pts:
        raise ValueError("a cost curve needs at least one measured point")
    return pts


def interpolate(points: dict | list, x: float) -> float:
    """Piecewise-linear in x through the measured points; flat below the first, the last segment extended above."""
    pts = _curve(points) if isinstance(points, dict) else points
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


@dataclasses.dataclass
class GpuCosts:
    """A ``pod_sim_model.StepCosts`` from measured milliseconds (the module docstring's format)."""

    decode_ms: dict
    verify_ms: dict = dataclasses.field(default_factory=dict)
    draft_ms: dict = dataclasses.field(default_factory=dict)
    spec_step_ms: dict = dataclasses.field(default_factory=dict)
    prefill_ms: dict = dataclasses.field(default_factory=dict)
    roundtrip_ms: float = 0.0
    compact_ms: float = 0.0
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _curve(self.decode_ms)

    def step_ms(self, batch: int) -> float:
        return interpolate(self.decode_ms, batch)

    def verify_pass_ms(self, batch: int, tree: int) -> float:
        """The policy's pass over ``tree`` tokens per row: linear in the tree size between measured sizes."""
        pts = [(1.0, self.step_ms(batch))] + [
            (float(n), interpolate(by_b, batch)) for n, by_b in self.verify_ms.items() if int(n) > 1
        ]
        if len(pts) == 1:
            raise KeyError(f"no measured verify pass (verify_ms) for a {tree}-token tree, and no spec_step_ms")
        return interpolate(sorted(pts), tree)

    def spec_step(self, batch: int, arm: ps.Arm) -> float:
        """Milliseconds of one speculative step of ``arm`` (drafting, verify, drafter extend)."""
        if arm.name in self.spec_step_ms:
            return interpolate(self.spec_step_ms[arm.name], batch)
        if not self.draft_ms:
            raise KeyError(f"no draft_ms and no spec_step_ms for {arm.name}: the drafter's cost is unknown")
        return self.verify_pass_ms(batch, arm.verify_tokens) + arm.depth * interpolate(self.draft_ms, batch)

    # StepCosts (seconds per engine call)
    def prefill(self, batch, prompts, length):
        return (interpolate(self.prefill_ms, batch) if self.prefill_ms else 0.0) / 1e3 + self.roundtrip_ms / 1e3

    def decode(self, batch, length, steps):
        return (steps * self.step_ms(batch) + self.roundtrip_ms) / 1e3

    def verify(self, batch, length, steps, arm):
        return (steps * self.spec_step(batch, arm) + self.roundtrip_ms) / 1e3

    def compact(self, src, dst):
        return self.compact_ms / 1e3


def from_suite(suite: dict, variant: str | None = None) -> dict:
    """gpu_suite.py's suite.json -> this module's format, from one variant of its ``decode`` section (default: the
    one with the fastest batch-1 decode)."""
    dec = suite.get("decode") or {}
    if not dec:
        raise ValueError("suite.json has no 'decode' section (skipped or failed in that run)")
    if variant is None:
        variant = min((v for v in dec if "decode_bs1" in dec[v]), key=lambda v: dec[v]["decode_bs1"]["ms"])
    out = {
        "source": f"gpu_suite.py decode section, variant {variant}",
        "device": suite.get("device_kind", ""),
        "model": "Qwen2.5-7B",
        "decode_ms": {},
        "verify_ms": {},
    }
    for row in dec[variant].values():
        b, n = str(row["batch"]), int(row.get("tree_tokens", 1))
        if n == 1:
            out["decode_ms"][b] = row["ms"]
        else:
            out["verify_ms"].setdefault(str(n), {})[b] = row["ms"]
        out["length"] = row.get("attend_len", out.get("length"))
    return out


def load(path: str, variant: str | None = None) -> GpuCosts:
    """GpuCosts from PATH (this format or suite.json); PATH#KEY reads that key of the file's JSON."""
    file, _, key = str(path).partition("#")
    data = json.loads(Path(file).read_text())
    if key:
        data = data[key]
    if "decode_ms" not in data:
        data = from_suite(data, variant)
    fields = {f.name for f in dataclasses.fields(GpuCosts)} - {"meta"}
    unknown = set(data) - fields - {"source", "device", "model", "length", "notes"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (see benchmarks/pod_sim_gpu.py for the format)")
    meta = {k: data[k] for k in ("source", "device", "model", "length", "notes") if k in data}
    return GpuCosts(**{k: v for k, v in data.items() if k in fields}, meta=meta)


def sd_speedup(costs: GpuCosts, arm: ps.Arm, batch: int) -> float:
    """Decode tokens/s of a fixed tree over plain decoding at ``batch`` live rows: accept x plain step / tree step."""
    return arm.accept * costs.step_ms(batch) / costs.spec_step(batch, arm)


def predict_rollout(
    lengths,
    prompt_len: int,
    costs: GpuCosts,
    *,
    max_batch: int,
    max_len: int,
    group: int = 1,
    arm: ps.Arm | None = None,
    threshold: int = 32,
    chunk_size: int = 8,
    steps_per_call: int = 4,
) -> ps.Trace:
    """The engine's rollout of responses of these lengths (one GRPO group = ``group`` consecutive rows), plain or
    speculating with ``arm`` at <= threshold live rows."""
    spec = dict(threshold=threshold, arms=((1, arm),)) if arm is not None else {}
    policy = ps.Policy(
        max_batch=max_batch, max_len=max_len, chunk_size=chunk_size, steps_per_call=steps_per_call, **spec
    )
    lengths = [max(1, int(n)) for n in lengths]
    return ps.simulate(lengths, [prompt_len] * len(lengths), policy, costs, group=group)


def compare(predicted: float, measured: float, tolerance: float = TOLERANCE) -> dict:
    """A predicted against a measured figure (seconds, a speedup): the relative error, and whether it is within the
    tolerance."""
    if not measured > 0:
        raise ValueError(f"the measured figure must be > 0, got {measured}")
    err = predicted / measured - 1.0
    return dict(predicted=predicted, measured=measured, error=err, tolerance=tolerance, within=abs(err) <= tolerance)


def validate_run(
    costs: GpuCosts,
    record: dict,
    *,
    arm: ps.Arm | None = None,
    threshold: int = 32,
    tolerance: float = TOLERANCE,
    skip_first: bool = True,
) -> dict:
    """Predicted against measured rollout seconds of one e2e mode of ``gpu_tlt.py`` (its ``e2e[mode]`` record:
    per step ``lengths`` (every response's tokens), ``rollout_s`` and ``compile_s``, and the run's ``prompt_len``,
    ``group``, ``max_batch``, ``max_len``), over the steps after the first (compiles), compile seconds left out of
    the measured side. With ``arm`` the prediction speculates at <= threshold live rows with that arm's acceptance
    (or each step's measured accept length, ``accept_length``, where given)."""
    steps = record["steps"][1:] if skip_first and len(record["steps"]) > 1 else record["steps"]
    rows, pred, meas = [], 0.0, 0.0
    for s in steps:
        a = arm
        if arm is not None and s.get("accept_length"):
            a = dataclasses.replace(arm, accept=max(1.0, float(s["accept_length"])))
        p = predict_rollout(
            s["lengths"],
            record["prompt_len"],
            costs,
            max_batch=record["max_batch"],
            max_len=record["max_len"],
            group=record.get("group", 1),
            arm=a,
            threshold=threshold,
        ).seconds
        m = s["rollout_s"] - (s.get("compile_s") or 0.0)
        rows.append(dict(step=s.get("step"), predicted_s=p, measured_s=m))
        pred, meas = pred + p, meas + m
    return dict(compare(pred, meas, tolerance), steps=rows, arm=None if arm is None else arm.name)


HARDWARE = {"H100": rf.H100, "H200": rf.H200}


def calibrated_hardware(costs: GpuCosts, model: rf.ModelSpec, hw: rf.Hardware | None = None) -> rf.Hardware:
    """``hw`` (by the costs' device name, default H100) with the roofline's free parameters fitted to the measured
    batch-1 costs of ``model``'s shape at the costs' cache length: bw_eff from the decode step, verify_scale from
    the 64-token verify pass (or the largest measured tree) over the roofline's, draft_s from draft_ms. Applied to
    another model's shape (32B from 7B costs) it is an extrapolation."""
    if hw is None:
        dev = costs.meta.get("device", "")
        hw = next((h for k, h in HARDWARE.items() if k in dev), rf.H100)
    length = int(costs.meta.get("length") or 4096)
    base = rf.Roofline(model, dataclasses.replace(hw, bw_eff=1.0, verify_scale=1.0), 1, length)
    bw_eff = base.policy(1, 1, length) / (costs.step_ms(1) / 1e3)
    fitted = dataclasses.replace(hw, bw_eff=min(bw_eff, 1.0))
    if costs.verify_ms:
        n = 64 if "64" in costs.verify_ms else max(int(k) for k in costs.verify_ms)
        r = rf.Roofline(model, fitted, 1, length)
        roof_ratio = r.policy(1, n, length) / r.policy(1, 1, length)
        fitted = dataclasses.replace(fitted, verify_scale=costs.verify_pass_ms(1, n) / costs.step_ms(1) / roof_ratio)
    if costs.draft_ms:  # the per-depth charge: the measured drafter forward beyond the roofline's own drafter bytes
        roof_draft = rf.Roofline(model, fitted, 1, length).drafter_fwd(1, 1, head=True)
        fitted = dataclasses.replace(fitted, draft_s=max(0.0, interpolate(costs.draft_ms, 1) / 1e3 - roof_draft))
    return dataclasses.replace(fitted, name=f"{hw.name}, fitted to {costs.meta.get('source', 'measured costs')}")


def report(
    costs: GpuCosts,
    run: dict | None = None,
    arm_name: str = "5x1x6",
    tolerance: float = TOLERANCE,
    project: bool = False,
    paper: dict | None = None,
) -> dict:
    """What ``pod_sim.py --gpu_costs`` writes: the decode speedups these costs predict where ``run`` (a gpu_tlt.py
    result) measured them (its best speculative arm and accept length per cell), the e2e rollouts predicted against
    measured (mode off plain; the speculative modes with ``arm_name`` at each step's measured accept length; an
    entry with ``failed`` where a cost is missing), and with ``project`` the Qwen2.5-7B / 32B pod projection on
    hardware fitted to the costs (beside ``paper``, the paper's step speedups by model and device count)."""
    out: dict = dict(costs=dataclasses.asdict(costs), tolerance=tolerance)
    if run:
        sd = []
        for temp, cells in (run.get("sd") or {}).items():
            for batch, cell in cells.items():
                best = cell.get("best_spec") or {}
                if not best.get("arm") or ":" not in best["arm"]:
                    continue
                d, k, n = (int(x) for x in best["arm"].split(":")[1].split("x"))
                arm = ps.Arm(d, k, n, max(1.0, best["accept"]))
                try:
                    pred = sd_speedup(costs, arm, int(batch))
                except KeyError as e:
                    sd.append(dict(temperature=temp, batch=int(batch), arm=best["arm"], failed=str(e)))
                    continue
                sd.append(
                    dict(
                        temperature=temp,
                        batch=int(batch),
                        arm=best["arm"],
                        accept=arm.accept,
                        **compare(pred, best["speedup"], tolerance),
                    )
                )
        out["sd_speedup"] = sd
        d, k, n = (int(x) for x in arm_name.split("x"))
        e2e = {}
        for mode, rec in (run.get("e2e") or {}).items():
            if isinstance(rec, dict) and rec.get("steps"):
                arm = None if mode == "off" else ps.Arm(d, k, n, 1.0)
                try:
                    e2e[mode] = validate_run(costs, rec, arm=arm, tolerance=tolerance)
                except (KeyError, ValueError) as e:
                    e2e[mode] = dict(failed=str(e))
        out["e2e_rollout"] = e2e
    if project:
        model = next((m for m in (rf.QWEN25_7B, rf.QWEN25_32B) if m.name == costs.meta.get("model")), None)
        if model is None:
            out["projection"] = dict(
                error=f"the projection fits the roofline to costs of a Qwen2.5-7B or -32B shape "
                f"(the costs' 'model'), not {costs.meta.get('model')!r}"
            )
            return out
        hw = calibrated_hardware(costs, model)
        arm = ps.Arm(depth=8, topk=4, verify_tokens=48, accept=6.53)
        st = ps.Staleness()
        rows = []
        for m, tp, responses in ((rf.QWEN25_7B, 4, 512), (rf.QWEN25_32B, 8, 2048)):
            for r in rf.projection_table(
                m, tp, responses, 32768, 256, device_counts=(8, 16, 32, 64), hw=hw, arm=arm, staleness=st, run_steps=100
            ):
                r["paper_step_speedup"] = (paper or {}).get(m.name, {}).get(r["devices"])
                rows.append(r)
        out["projection"] = dict(hardware=dataclasses.asdict(hw), fitted_on=model.name, rows=rows)
    return out
