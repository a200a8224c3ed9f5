"""The run's summary numbers (validation means over data sources) and its plot: one panel per logged quantity, or
none when the records hold no plotted metric (an empty plot would look like a run that learned nothing)."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.trainer.plot import plot_run, validation_mean, validation_reward

sources = st.sampled_from(["a", "arithmetic/gsm8k-format/level-1", "x/y"])
entries = st.lists(
    st.tuples(
        sources,
        st.sampled_from(["reward", "acc", "format"]),
        st.sampled_from(["core", "aux"]),
        st.integers(1, 8),
        st.floats(0, 1),
    ),
    max_size=12,
)


@given(entries)
def test_validation_mean_is_the_largest_n_per_source_averaged_over_sources(items):
    record = {f"val-{kind}/{source}/{var}/mean@{n}": v for source, var, kind, n, v in items}
    record |= {"step": 3, "critic/score/mean": 0.5, "val-aux/a/acc/std@2": 0.25}  # never picked up
    for var in ("reward", "acc", "format"):
        best: dict[str, tuple[int, float]] = {}
        for key, value in record.items():  # the reference: parse the names by splitting them
            parts = key.split("/")
            if parts[0] in ("val-core", "val-aux") and parts[-2] == var and parts[-1].startswith("mean@"):
                source, n = "/".join(parts[1:-2]), int(parts[-1][5:])
                if source not in best or n > best[source][0]:
                    best[source] = (n, value)
        expected = math.fsum(v for _, v in best.values()) / len(best) if best else None
        assert validation_mean(record, var) == pytest.approx(expected)
    assert validation_reward(record) == validation_mean(record, "reward")


def test_validation_mean_skips_missing_and_non_finite_values():
    record = {
        "val-core/a/acc/mean@1": None,
        "val-core/b/acc/mean@1": float("nan"),
        "val-core/c/acc/mean@1": 0.5,
    }
    assert validation_mean(record, "acc") == 0.5
    assert validation_mean({"val-core/a/acc/mean@1": None}, "acc") is None


def _size(path: str) -> tuple[int, int]:
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def _full_run(steps: int = 4) -> list[dict]:
    records = []
    for step in range(steps + 1):
        r: dict = {"step": step}
        if step:
            r |= {
                "critic/score/mean": step / 10,
                "response_length/mean": 20 - step,
                "response_length/clip_ratio": 0.5 / step,
                "actor/entropy": 1.0 / step,
                "actor/ref_kl": 0.01 * step,
                "training/rollout_probs_diff_mean": 1e-3,
                "training/rollout_probs_diff_max": 1e-2,
            }
        if step % 2 == 0:
            r |= {
                "val-core/s/acc/mean@1": step / 8,
                "val-aux/s/format/mean@1": min(1.0, step / 2),
                "val-aux/s/reward/mean@1": step / 8,
                "val-aux/s/response_length/mean@1": 20 - step,
                "val-aux/s/response_clipped/mean@1": 0.1,
            }
        records.append(r)
    return records


def test_the_plot_has_a_panel_per_logged_quantity(tmp_path):
    pytest.importorskip("matplotlib")
    full = plot_run(_full_run(), str(tmp_path / "full.png"), "full")
    reward_only = plot_run(
        [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.7}],
        str(tmp_path / "reward.png"),
        "reward only",
    )
    # the reward (always drawn) alone: one panel; the full run's seven: two columns of four rows
    assert _size(reward_only) == (700, 300)
    assert _size(full) == (1400, 1200)
    # without the mismatch and the entropy: five panels, three rows
    partial = [
        {k: v for k, v in r.items() if not k.startswith(("training/", "actor/entropy"))} for r in _full_run()
    ]
    assert _size(plot_run(partial, str(tmp_path / "partial.png"), "partial")) == (1400, 900)


def test_no_metrics_no_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "p.png")
    assert plot_run([], path, "t") is None and not os.path.exists(path)
    assert plot_run([{"step": 1, "timing_s/gen": 0.5}], path, "t") is None and not os.path.exists(path)


def test_a_reward_curve_is_plotted(tmp_path):
    pytest.importorskip("matplotlib")
    records = [{"step": s, "critic/score/mean": s / 10} for s in range(1, 4)]
    path = str(tmp_path / "p.png")
    assert plot_run(records, path, "t") == path and os.path.getsize(path) > 0
