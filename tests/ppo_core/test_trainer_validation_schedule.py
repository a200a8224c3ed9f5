"""When the trainer validates: ``val_before_train`` applies to a fresh start only (verl validates again on every
resume), and ``test_freq = 0`` still validates once, at the end. Uses the toy workers of ``test_trainer_loop``."""

from __future__ import annotations

import os

import pytest
from test_trainer_loop import ToyTrainer, crash_at, make_config, run

from ppo_core.trainer import RewardFunctionError, read_metrics_jsonl


def _validated_steps(path: str | os.PathLike[str]) -> list[int]:
    """The steps of the ``metrics.jsonl`` records that hold validation metrics, in file order."""
    return [r["step"] for r in read_metrics_jsonl(path) if any(k.startswith("val-") for k in r)]


def test_val_before_train_runs_on_a_fresh_start_only(tmp_path) -> None:
    cfg = make_config(
        tmp_path, trainer={"total_epochs": 1, "save_freq": 1, "test_freq": 0, "val_before_train": True}
    )
    with pytest.raises(RewardFunctionError, match="step 3"):
        run(ToyTrainer, cfg, reward_fn=crash_at(3))
    assert _validated_steps(tmp_path) == [0]
    resumed = run(ToyTrainer, cfg)  # continues from the checkpoint of step 2
    assert resumed.global_steps == 3
    assert _validated_steps(tmp_path) == [0, 3]  # no second validation before the resumed steps
