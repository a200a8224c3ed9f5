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
