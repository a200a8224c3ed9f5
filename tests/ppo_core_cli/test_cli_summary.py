"""The line ``ppo-core train`` prints first: validation reward, accuracy and format rate before -> after."""

from __future__ import annotations

from ppo_core_cli.main import _train_summary
from ppo_core_cli.train import TrainResult


def test_summary_names_what_the_run_validated():
    result = TrainResult(run_dir="r", metrics_file="m", steps=30, wall_seconds=151.4)
    assert _train_summary(result) == "trained 30 steps in 151 s"
    result.initial_val_reward, result.final_val_reward = 0.125, 0.5
    result.initial_val_accuracy, result.final_val_accuracy = 0.0625, 0.5
    assert _train_summary(result) == (
        "trained 30 steps in 151 s; validation reward 0.125 -> 0.500 (+0.375), accuracy 6.2% -> 50.0%"
    )
    result.initial_val_format, result.final_val_format = 0.0, 0.96875
    assert _train_summary(result).endswith("accuracy 6.2% -> 50.0%, format rate 0.0% -> 96.9%")
