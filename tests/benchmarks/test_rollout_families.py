"""``benchmarks/rollout_families.py --tiny``: the GPU benchmark's code end to end on the CPU (tiny shapes), so that
its one GPU run cannot fail for a reason a CPU would show."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import rollout_families


@pytest.mark.slow
def test_tiny_run_reports_every_family(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "families.json"
    result = rollout_families.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    paths = {
        "llama": "fused",
        "qwen3": "fused",
        "llama_as_qwen3": "fused",
        "neox": "generic",
        "neox_compiled": "generic",
    }
    for name, path in paths.items():
        entry = result[name]
        assert entry["ours"]["path"] == path
        assert entry["ours"]["new_tokens"] == 2 * 4
        ours = entry["ours"]["new_tokens_per_s"]
        assert entry["ours_pct_of_bound"] == round(100 * ours / entry["bound_new_tokens_per_s"], 1)
        assert entry["recompile_limit_hits"] == []
        assert not [w for w in entry["warnings"] if w.startswith("ppo_core")]
        assert result["summary"][name]["ours_new_tokens_per_s"] == ours
        assert ("graph_breaks" in entry["ours"]) == (name in rollout_families.COMPILED_FORWARD)
        if name in rollout_families.NO_REFERENCE:
            assert "hf_static" not in entry and "ours_over_hf_static" not in entry
            continue
        assert entry["hf_static"]["new_tokens"] == 2 * 4
        assert entry["ours_over_hf_static"] == round(ours / entry["hf_static"]["new_tokens_per_s"], 2)


def test_unknown_family_is_named() -> None:
    with pytest.raises(SystemExit, match="unknown \\['gpt2'\\]"):
        rollout_families.main(["--tiny", "--families", "llama,gpt2"])


def test_weight_bytes_counts_tied_embeddings_once() -> None:
    import torch

    tied = rollout_families.build("qwen3", torch.device("cpu"), torch.bfloat16, tiny=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    every = [p for _, p in tied.named_parameters(remove_duplicate=False)]
    unique = {id(p): p for p in every}
    assert rollout_families.weight_bytes(tied) == 2 * sum(p.numel() for p in unique.values())
    assert rollout_families.weight_bytes(tied) < 2 * sum(p.numel() for p in every)


def test_a_failing_method_and_the_warnings_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    def ours(model, case, repeats):
        logging.getLogger("ppo_core_decode.decoding").warning("capturing failed\nsecond line")
        return {"new_tokens_per_s": 10.0, "decode_new_tokens_per_s": 20.0}

    def hf_static(model, case, repeats):
        raise RuntimeError("no static cache")

    monkeypatch.setattr(rollout_families, "ours", ours)
    monkeypatch.setattr(rollout_families, "hf_static", hf_static)
    result = rollout_families.main(["--tiny", "--families", "neox"])
    entry = result["neox"]
    assert entry["warnings"] == ["ppo_core_decode.decoding: capturing failed"]
    assert entry["hf_static"]["error"] == "RuntimeError: no static cache"
    assert "ours_over_hf_static" not in entry and entry["ours"]["new_tokens_per_s"] == 10.0


@pytest.mark.slow
def test_the_compiled_forward_experiment_leaves_dynamos_limits_as_they_were() -> None:
    import torch

    before = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    result = rollout_families.main(["--tiny", "--families", "neox_compiled"])
    assert result["neox_compiled"]["ours"]["path"] == "generic"
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == before
