"""benchmarks/batch_invariant.py on the CPU (``--tiny``): every method is timed and checked for batch invariance,
the chunked path has the property, and the result is the JSON printed and written."""

from __future__ import annotations

import json

from benchmarks import batch_invariant


def test_a_smoke_run_times_each_method_and_checks_its_rows(tmp_path, capsys) -> None:
    out = tmp_path / "bi.json"
    result = batch_invariant.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    cases = result["shapes"]["tiny:float32"]
    assert set(cases) == {"qkv:70", "down:70", "sum_over_projections"}
    for name in ("qkv:70", "down:70"):
        case = cases[name]
        assert case["m"] == 70 and case["gflop"] == round(2 * 70 * case["k"] * case["n"] / 1e9, 3)
        assert case["chunked"]["bits"] is True  # the chunked path is batch-invariant by construction
        assert case["chunked"]["ms"] > 0 and case["f_linear"]["ms"] > 0
    totals = cases["sum_over_projections"]
    assert totals["chunked:70_ms"] == round(
        cases["qkv:70"]["chunked"]["ms"] + cases["down:70"]["chunked"]["ms"], 3
    )


def test_rows_alike_notices_a_row_that_depends_on_the_others() -> None:
    import torch

    x, w = torch.randn(70, 8), torch.randn(4, 8)
    assert batch_invariant._rows_alike(batch_invariant.bi.linear_chunked, x, w) is True
    assert batch_invariant._rows_alike(lambda a, b: (a @ b.T) + a.shape[0], x, w) is False
