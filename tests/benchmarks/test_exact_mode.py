"""benchmarks/exact_mode.py on the CPU (the tiny shape): both modes run the same steps, the exact mode's
``rollout_probs_diff_max`` is 0 on every step and the fast mode's is not, the ratios compare the two."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import exact_mode


def test_a_smoke_run_reports_both_modes_and_their_ratios(tmp_path, capsys) -> None:
    out = tmp_path / "exact.json"
    argv = ["--device", "cpu", "--shape", "tiny", "--prompts", "3", "--n", "2", "--prompt-tokens", "6"]
    result = exact_mode.main(
        [*argv, "--response-tokens", "5", "--steps", "1", "--warmup", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    fast, exact = result["fast"], result["exact"]
    assert exact["rollout_probs_diff_max"] == [0.0, 0.0]
    assert all(d > 0 for d in fast["rollout_probs_diff_max"])
    assert result["ratios"]["step_s"] == pytest.approx(exact["step_s"] / fast["step_s"])
    assert fast["rollout_tokens_per_s"] == pytest.approx(3 * 2 * 5 / fast["rollout_s"])


def test_the_default_token_budgets_are_the_real_jobs() -> None:
    # budgets above the real job's ran out of an 80 GB GPU's memory at the default 64 x 8 rows
    from pathlib import Path

    import yaml

    job = yaml.safe_load(
        (Path(exact_mode.__file__).parents[1] / "examples/configs/smollm2_grpo.yaml").read_text()
    )
    worker = job["actor"]["worker"]
    config = exact_mode.worker_config(exact_mode.parse_args([]), exact=True)
    assert config["ppo_max_token_len_per_gpu"] == worker["ppo_max_token_len_per_gpu"] == 16384
    assert config["forward_max_token_len_per_gpu"] == worker["forward_max_token_len_per_gpu"] == 32768


def test_the_token_budgets_can_be_set() -> None:
    args = exact_mode.parse_args(["--ppo-max-tokens", "512", "--forward-max-tokens", "1024"])
    config = exact_mode.worker_config(args, exact=False)
    assert (config["ppo_max_token_len_per_gpu"], config["forward_max_token_len_per_gpu"]) == (512, 1024)
