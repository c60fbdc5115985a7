"""Run plots: each PNG is written from the files a run leaves in its workdir, and only when there is data for it; the
metrics file they read keeps figures not measured as null (and out of TensorBoard)."""

import json
import os

from tlt_jax.metrics.plots import PLOT_FILES, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_every_plot_written_from_run_files(tmp_path):
    wd = str(tmp_path)
    _jsonl(
        os.path.join(wd, "metrics.jsonl"),
        [
            {
                "step": s,
                "kind": "train",
                "reward/mean": 0.1 * s,
                "reward/accuracy": 0.05 * s,
                "rollout/accept_length": 2.0 + 0.1 * s,
                "response/len_p50": 40,
                "response/len_p90": 90,
            }
            for s in (1, 2, 3)
        ]
        + [{"step": 3, "kind": "final", "eval/accuracy": 0.2}],
    )
    _jsonl(os.path.join(wd, "lengths.jsonl"), [{"step": s, "lengths": [10, 20, 30 * s, 128]} for s in (1, 2, 3)])
    _jsonl(
        os.path.join(wd, "timeline.jsonl"),
        [
            {"step": 3, "slice": 0, "state": "busy", "start": 10.0, "end": 12.0},
            {"step": 3, "slice": 0, "state": "training", "start": 12.0, "end": 15.0},
            {"step": 3, "slice": 1, "state": "busy", "start": 10.0, "end": 15.0},
        ],
    )
    written = write_plots(wd)
    assert sorted(os.path.basename(p) for p in written) == sorted(PLOT_FILES.values())
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(p) > 2000


def test_only_plots_with_data_and_cut_lines_tolerated(tmp_path):
    wd = str(tmp_path)
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "reward/mean": 0.5, "response/len_max": 64}) + "\n")
        f.write('{"step": 2, "reward/me')  # a row cut short by a kill
    written = write_plots(wd)
    assert sorted(os.path.basename(p) for p in written) == sorted([PLOT_FILES["reward"], PLOT_FILES["lengths"]])
    assert not os.path.exists(os.path.join(wd, "plots", PLOT_FILES["timeline"]))


def test_running_mean_of_the_last_steps():
    from tlt_jax.metrics.plots import _running_mean

    assert _running_mean([0.0, 1.0, 0.5, 0.5, 1.0], 4) == [0.0, 0.5, 0.5, 0.5, 0.75]


def test_metrics_writer_logs_nan_as_null_and_leaves_it_off_tensorboard(tmp_path, caplog):
    """A figure that was not measured this step (NaN, e.g. a held-out score that was dropped) is null in
    metrics.jsonl and no point in TensorBoard (tensorboardX would warn for each NaN scalar)."""
    import logging

    from tlt_jax.metrics.writers import MetricsWriter

    w = MetricsWriter(str(tmp_path), tensorboard=True)
    with caplog.at_level(logging.WARNING):
        w.write(1, {"drafter/top1": float("nan"), "reward/mean": 0.5})
        w.close()
    assert not [r for r in caplog.records if "NaN" in r.getMessage()]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["drafter/top1"] is None and row["reward/mean"] == 0.5
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_accept_length_plot_leaves_gaps_where_nothing_was_speculated(tmp_path):
    """A step with no verify step reports accept length 0 by convention: the plot's series has a gap there (NaN),
    and the held-out accept length alone still draws the plot."""
    from tlt_jax.metrics.plots import accept_series

    rows = [{"step": 1, "rollout/accept_length": 0.0, "rollout/verify_steps": 0},
            {"step": 2, "rollout/accept_length": 2.5, "rollout/verify_steps": 3},
            {"step": 3, "rollout/accept_length": 0.0, "rollout/verify_steps": 0}]
    steps, acc = accept_series(rows)
    assert steps == [1, 2, 3] and acc[1] == 2.5 and all(a != a for a in (acc[0], acc[2]))
    wd = str(tmp_path)
    _jsonl(os.path.join(wd, "metrics.jsonl"), [{"step": 4, "kind": "final", "eval/accuracy": 0.5,
                                                "eval/accept_length": 3.0}])
    assert os.path.basename(write_plots(wd)[-1]) == PLOT_FILES["accept"]


def test_plotter_redraws_once_a_minute_and_at_the_end(tmp_path):
    """The main job's Plotter: no redraw before ``every_s`` since the start or the last one, one when it is due (the
    files appear then), and always the final one."""
    from tlt_jax.metrics.plots import Plotter

    wd, now = str(tmp_path), [100.0]
    _jsonl(os.path.join(wd, "metrics.jsonl"), [{"step": 1, "reward/mean": 0.5, "response/len_max": 64}])
    plots = Plotter(wd, every_s=60.0, clock=lambda: now[0])
    reward = os.path.join(wd, "plots", PLOT_FILES["reward"])
    now[0] = 159.0
    plots()
    assert plots.redraws == 0 and not os.path.exists(reward)
    now[0] = 160.0
    plots()
    assert plots.redraws == 1 and os.path.exists(reward)
    now[0] = 200.0
    plots()
    assert plots.redraws == 1
    plots(final=True)
    assert plots.redraws == 2
