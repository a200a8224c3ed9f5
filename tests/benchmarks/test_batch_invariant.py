"""benchmarks/batch_invariant.py on the CPU (``--tiny``): every method is timed and checked for batch invariance,
the chunked path has the property, and the result is the JSON printed and written."""

from __future__ import annotations

import json

import pytest

from benchmarks import batch_invariant


def test_a_smoke_run_times_each_method_and_checks_its_rows(tmp_path, capsys) -> None:
    out = tmp_path / "bi.json"
    result = batch_invariant.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    cases = result["shapes"]["tiny:float32"]
    assert set(cases) == {"qkv:70", "down:70", "head:70", "forward_ms"}
    for name in ("qkv:70", "down:70", "head:70"):
        case = cases[name]
        assert case["m"] == 70 and case["gflop"] == round(2 * 70 * case["k"] * case["n"] / 1e9, 3)
        assert case["chunked"]["bits"] is True  # the chunked path is batch-invariant by construction
        assert case["chunked"]["ms"] > 0 and case["f_linear"]["ms"] > 0
        assert case["path"] == "chunked"  # no Triton on this CPU (without TRITON_INTERPRET=1)
    totals = cases["forward_ms"]
    layer = cases["qkv:70"]["chunked"]["ms"] + cases["down:70"]["chunked"]["ms"]
    assert totals["chunked:70_ms"] == pytest.approx(2 * layer + cases["head:70"]["chunked"]["ms"], abs=2e-3)
    assert totals["invariant_linear:70_ms"] == totals["chunked:70_ms"]


def test_forward_totals_weigh_layers_and_take_each_weights_path() -> None:
    def case(tri, chunk, path):
        return {"triton": {"ms": tri}, "chunked": {"ms": chunk}, "f_linear": {"ms": 0.5}, "path": path}

    cases = {
        "qkv:8": case(1.0, 3.0, "triton"),
        "head:8": case(10.0, 4.0, "chunked"),
        "qkv:9": case(2.0, 2.0, "x"),
    }
    totals = batch_invariant.forward_totals(cases, layers=3, rows=[8])
    assert totals == {
        "triton:8_ms": 3 * 1.0 + 10.0,
        "chunked:8_ms": 3 * 3.0 + 4.0,
        "f_linear:8_ms": 3 * 0.5 + 0.5,
        "invariant_linear:8_ms": 3 * 1.0 + 4.0,
    }


def test_rows_alike_notices_a_row_that_depends_on_the_others() -> None:
    import torch

    x, w = torch.randn(70, 8), torch.randn(4, 8)
    assert batch_invariant._rows_alike(batch_invariant.bi.linear_chunked, x, w) is True
    assert batch_invariant._rows_alike(lambda a, b: (a @ b.T) + a.shape[0], x, w) is False
