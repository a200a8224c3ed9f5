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


def _run(task, path, resident: bool, algo: str, hosts: int = 0) -> tuple[dict, list]:
    """Three steps of the digits example on 2 Monarch processes (or 2 on each of ``hosts`` simulated hosts: worker
    loops on 127.0.0.1, started for the run and stopped after it): ``grpo`` (no KL loss), ``grpo_kl`` (the grpo
    preset's KL loss: reference log-probs) or ``ppo`` (GAE, a colocated critic, the KL penalty in the reward)."""
    import torch
    from _procs import remember_pids

    from ppo_core_monarch import attach_hosts, start_worker_loops

    ppo_digits, monarch_example = task
    args = ppo_digits.parse_args(
        [
            "--algo",
            "ppo" if algo == "ppo" else "grpo",
            "--steps",
            "3",
            "--prompts-per-step",
            "4",
            "--n",
            "4",
            "--out-dir",
            str(path),
        ]
    )
    cfg = ppo_digits.make_config(args)
    if algo in ("grpo", "grpo_corrected"):  # no reference: plain GRPO
        cfg["actor"]["use_kl_loss"] = cfg["actor"]["worker"]["use_kl_loss"] = False
    if algo == "grpo_corrected":  # the rollout correction's weights, normalisation and rejection at the ranks
        cfg["algorithm"]["rollout_correction"] = {
            "rollout_is": "token",
            "rollout_is_threshold": 2.0,
            "rollout_is_batch_normalize": True,
            "rollout_rs": "token_k1",
            "rollout_rs_threshold": 2.0,
        }
    if hosts:  # dp = 4: one mini-batch of the step's responses, which the four ranks share
        rows = cfg["data"]["train_batch_size"] * cfg["rollout"]["n"]
        for role in ("actor", "critic"):
            if "worker" in cfg.get(role, {}):
                cfg[role]["worker"]["ppo_mini_batch_size"] = rows
    cfg["trainer"]["resident_batches"] = resident
    cfg["trainer"]["test_freq"] = 0
    g = torch.Generator().manual_seed(0)
    weights = ppo_digits.format_warmup(2, g)
    loops = start_worker_loops(hosts) if hosts else None  # a fresh set per run: a group's procs end with it
    try:
        if loops is not None:
            remember_pids(loops.pids)
        addresses = None if loops is None else loops.addresses
        trainer = MonarchPPOTrainer(
            cfg,
            roles=monarch_example.roles_for(weights),
            procs_per_host=2,
            hosts=None if addresses is None else (lambda: attach_hosts(addresses)),
            monarch=MonarchConfig(
                torch_threads=1, ready_timeout_s=180.0, shared_memory=addresses is None, call_timeout_s=300.0
            ),
            train_dataset=ppo_digits.make_dataset(64, g),
            val_dataset=ppo_digits.make_dataset(8, g),
            reward_fn=ppo_digits.digit_sum_reward,
            pad_token_id=ppo_digits.PAD,
        )
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    finally:
        if loops is not None:
            loops.stop()
    skip = ("timing_s/", "timing_per_token_ms/", "perf/")
    records = read_metrics_jsonl(str(path))
    sent = [r["perf/controller_bytes_sent"] for r in records if "perf/controller_bytes_sent" in r]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in records}, sent


@pytest.mark.parametrize("algo", ["grpo", "grpo_kl", "ppo", "grpo_corrected"])
def test_resident_run_equals_the_by_value_run_on_two_processes(task, tmp_path, algo):
    """On 2 Monarch processes (DDP over gloo), three steps with the batch resident equal the by-value run (GRPO with
    and without the KL loss, GRPO with the rollout correction's weights and rejection, PPO): every
    metric within 1e-6 relative (GRPO's per-row advantages and PPO's whitened ones are the same bits; what sums whitened
    advantages, e.g. the policy loss, is reduced from per-rank parts and compared at their unit scale), with
    fewer bytes sent through the controller."""
    _check_runs(task, tmp_path, algo)


@pytest.mark.parametrize("algo", ["grpo_kl", "ppo"])
def test_resident_run_equals_the_by_value_run_on_two_simulated_hosts(task, tmp_path, algo):
    """The same on 2 simulated hosts x 2 processes (worker loops on 127.0.0.1, pickled over TCP; dp = 4)."""
    _check_runs(task, tmp_path, algo, hosts=2)


def _check_runs(task, tmp_path, algo, hosts=0):
    by_value, value_sent = _run(task, tmp_path / "value", False, algo, hosts)
    resident, resident_sent = _run(task, tmp_path / "resident", True, algo, hosts)
    # the batch no longer goes back out to the log-prob, reference, value and update calls
    assert len(resident_sent) == len(value_sent) == 3
    # (the first resident step also sends the training prompts' token ids, once: then only indices)
    assert all(r < v for r, v in zip(resident_sent[1:], value_sent[1:], strict=True)), (
        resident_sent,
        value_sent,
    )
    assert sorted(by_value) == sorted(resident) and {1, 2, 3} <= set(by_value)
    for step, values in by_value.items():
        assert resident[step].keys() == values.keys()
        # PPO's whitened advantages are the by-value bits (per-row partials reduced exactly), so no step drifts:
        # the metrics reduced from per-rank parts agree within 1e-6 (at the advantages' unit scale for what cancels)
        rel = 1e-6
        noise = 1e-9 if algo != "ppo" else rel
        for key, value in values.items():
            got = resident[step][key]
            assert got == pytest.approx(value, rel=rel, abs=noise, nan_ok=True), (step, key)
    if algo == "ppo":
        assert "critic/vf_explained_var" in by_value[3] and "actor/reward_kl_penalty" in by_value[3]
    if (
        algo == "grpo_corrected"
    ):  # the correction ran (weights normalised by the batch's mean, rejection counted)
        assert {
            "rollout_corr/rollout_is_batch_norm_factor",
            "rollout_corr/rollout_rs_masked_fraction",
        } <= set(by_value[3])
    if algo == "grpo_kl":
        assert "actor/kl_loss" in by_value[3] or any(k.startswith("actor/kl") for k in by_value[3])
