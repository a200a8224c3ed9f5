"""The main example learns: a short run of ``examples/ppo_digits.py`` raises the mean reward, for PPO and GRPO."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ppo_digits.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("ppo_digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    """The example, whose format warm-up runs once for PPO and GRPO: both start it from the same seed, so the
    second run gets the first's weights and its generator continues from where the warm-up left it."""
    module = _load_example()
    warmup, done = module.format_warmup, {}

    def format_warmup_once(steps: int, generator: torch.Generator, batch_size: int = 128) -> dict:
        key = (steps, batch_size, generator.get_state().numpy().tobytes())
        if key not in done:
            done[key] = (warmup(steps, generator, batch_size), generator.get_state())
        weights, after = done[key]
        generator.set_state(after)
        return {k: v.clone() for k, v in weights.items()}

    module.format_warmup = format_warmup_once
    return module


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_short_run_improves_reward(example, algo: str, tmp_path: pathlib.Path) -> None:
    summary = example.main(["--algo", algo, "--steps", "50", "--out-dir", str(tmp_path)])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rewards = [r["critic/score/mean"] for r in records if r.get("critic/score/mean") is not None]
    assert len(rewards) == 50
    assert summary["initial_reward"] == rewards[0]
    # after the format warm-up the reward is about 0.35; 50 RL steps reach about 0.7
    assert summary["final_reward"] > summary["initial_reward"] + 0.2, summary
    assert (tmp_path / "reward_kl.png").stat().st_size > 0
    assert all(r.get("actor/ref_kl") is not None for r in records if r.get("critic/score/mean") is not None)


def test_reward_function_rules() -> None:
    example = _load_example()
    import torch
    from tensordict import NonTensorStack, TensorDict

    d, eos, pad = example.DIGIT0, example.EOS, example.PAD
    responses = torch.tensor(
        [
            [d + 9, d + 2, d + 6, eos, pad],  # sum 17 == target: 1
            [d + 9, d + 2, d + 1, eos, pad],  # sum 12, off by 5: 0.5
            [d + 9, d + 9, d + 9, eos, pad],  # sum 27, off by 27: 0
            [d + 9, d + 2, d + 6, d + 1, eos],  # four digits: malformed
            [d + 9, d + 2, eos, pad, pad],  # two digits: malformed
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 0]] * 3 + [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    batch = TensorDict(
        {"responses": responses, "response_mask": mask, "ground_truth": NonTensorStack(*[17, 17, 0, 17, 17])},
        batch_size=[5],
    )
    assert example.digit_sum_reward(batch).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert example.encode_prompt(17) == [example.BOS, d + 1, d + 7, example.EQ]
