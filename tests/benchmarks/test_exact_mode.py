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
