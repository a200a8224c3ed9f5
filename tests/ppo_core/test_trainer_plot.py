"""``plot_run``: a plot of the reward and KL curves, or none when the records hold neither (an empty plot would
look like a run that learned nothing)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("matplotlib")

from ppo_core.trainer.plot import plot_run


def test_no_metrics_no_plot(tmp_path):
    path = str(tmp_path / "p.png")
    assert plot_run([], path, "t") is None and not os.path.exists(path)
    assert plot_run([{"step": 1, "timing_s/gen": 0.5}], path, "t") is None and not os.path.exists(path)


def test_a_reward_curve_is_plotted(tmp_path):
    records = [{"step": s, "critic/score/mean": s / 10} for s in range(1, 4)]
    path = str(tmp_path / "p.png")
    assert plot_run(records, path, "t") == path and os.path.getsize(path) > 0
