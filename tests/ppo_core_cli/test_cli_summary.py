"""The line ``ppo-core train`` prints first: validation reward, accuracy and format rate before -> after."""

from __future__ import annotations

from ppo_core_cli.main import _train_summary
from ppo_core_cli.train import TrainResult, _set_validation_ends


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


def test_one_validation_is_no_before_and_after():
    # trainer.val_before_train=false and one validation at the end: its numbers, not "X -> X (+0.000)"
    record = {"step": 2, "val-core/s/acc/mean@1": 0.078125, "val-aux/s/reward/mean@1": 0.078125}
    result = TrainResult(run_dir="r", metrics_file="m", steps=2, wall_seconds=2.0)
    _set_validation_ends(result, [{"step": 1, "actor/pg_loss": 0.1}, record])
    assert _train_summary(result) == "trained 2 steps in 2 s; validation reward 0.078, accuracy 7.8%"
    _set_validation_ends(result, [{**record, "step": 0, "val-aux/s/reward/mean@1": 0.0}, record])
    assert _train_summary(result).endswith("validation reward 0.000 -> 0.078 (+0.078), accuracy 7.8% -> 7.8%")


def test_one_step_is_singular():
    result = TrainResult(run_dir="r", metrics_file="m", steps=1, wall_seconds=3.0)
    assert _train_summary(result) == "trained 1 step in 3 s"
