"""MonarchPPOTrainer runs the digits example's PPO steps on 2 Monarch processes (DDP over gloo), colocated roles.

The full learning comparison with the local backend is ``examples/monarch_ppo_digits.py`` (README); here a few
steps check the wiring: both roles answer from both ranks, metrics are produced, everything shuts down.
"""

from __future__ import annotations

import os
import sys

import pytest

from ppo_core.trainer import read_metrics_jsonl
from ppo_core_monarch import MonarchConfig, MonarchPPOTrainer

pytestmark = [pytest.mark.monarch, pytest.mark.slow]

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.fixture(scope="module")
def task():
    path = os.path.abspath(EXAMPLES)
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])
    import monarch_ppo_digits
    import ppo_digits

    yield ppo_digits, monarch_ppo_digits
    sys.path.remove(path)


def test_ppo_steps_on_two_ranks(task, tmp_path):
    import torch

    ppo_digits, monarch_example = task
    args = ppo_digits.parse_args(["--steps", "2", "--prompts-per-step", "16", "--out-dir", str(tmp_path)])
    g = torch.Generator().manual_seed(0)
    weights = ppo_digits.format_warmup(2, g)
    trainer = MonarchPPOTrainer(
        ppo_digits.make_config(args),
        roles=monarch_example.roles_for(weights),
        procs_per_host=2,
        monarch=MonarchConfig(torch_threads=1, ready_timeout_s=180.0),
        train_dataset=ppo_digits.make_dataset(64, g),
        val_dataset=ppo_digits.make_dataset(8, g),
        reward_fn=ppo_digits.digit_sum_reward,
        pad_token_id=ppo_digits.PAD,
    )
    try:
        metrics = trainer.fit()
        group = trainer.groups[0]
        assert group.world_size == 2 and trainer.actor_wg.world_size == 2
        assert trainer.critic_wg is not None and trainer.critic_wg.layout.dp_size == 2
    finally:
        trainer.shutdown()
        trainer.shutdown()
    assert group.closed
    records = read_metrics_jsonl(str(tmp_path))
    assert [r["step"] for r in records if "critic/score/mean" in r] == [1, 2]
    assert metrics and all(v == v for v in metrics.values() if isinstance(v, float))  # no NaN


def _grpo_run(task, path, resident: bool) -> dict:
    import torch

    ppo_digits, monarch_example = task
    args = ppo_digits.parse_args(
        ["--algo", "grpo", "--steps", "3", "--prompts-per-step", "4", "--n", "4", "--out-dir", str(path)]
    )
    cfg = ppo_digits.make_config(args)
    cfg["actor"]["use_kl_loss"] = cfg["actor"]["worker"]["use_kl_loss"] = False  # no reference: plain GRPO
    cfg["trainer"]["resident_batches"] = resident
    cfg["trainer"]["test_freq"] = 0
    g = torch.Generator().manual_seed(0)
    weights = ppo_digits.format_warmup(2, g)
    trainer = MonarchPPOTrainer(
        cfg,
        roles=monarch_example.roles_for(weights),
        procs_per_host=2,
        monarch=MonarchConfig(torch_threads=1, ready_timeout_s=180.0),
        train_dataset=ppo_digits.make_dataset(64, g),
        val_dataset=ppo_digits.make_dataset(8, g),
        reward_fn=ppo_digits.digit_sum_reward,
        pad_token_id=ppo_digits.PAD,
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    skip = ("timing_s/", "timing_per_token_ms/", "perf/")
    records = read_metrics_jsonl(str(path))
    sent = [r["perf/controller_bytes_sent"] for r in records if "perf/controller_bytes_sent" in r]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in records}, sent


def test_resident_grpo_equals_the_by_value_run_on_two_processes(task, tmp_path):
    """GRPO on 2 Monarch processes (DDP over gloo): every metric of three steps equal with the batch resident, and
    fewer bytes sent through the controller."""
    by_value, value_sent = _grpo_run(task, tmp_path / "value", resident=False)
    resident, resident_sent = _grpo_run(task, tmp_path / "resident", resident=True)
    # the batch no longer goes back out to compute_log_prob and update_actor
    assert len(resident_sent) == len(value_sent) == 3
    assert all(r < v for r, v in zip(resident_sent, value_sent, strict=True))
    assert sorted(by_value) == sorted(resident) and {1, 2, 3} <= set(by_value)
    for step, values in by_value.items():
        assert resident[step].keys() == values.keys()
        for key, value in values.items():
            assert resident[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)
