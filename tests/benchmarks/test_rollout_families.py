"""``benchmarks/rollout_families.py --tiny``: the GPU benchmark's code end to end on the CPU (tiny shapes), so that
its one GPU run cannot fail for a reason a CPU would show."""

from __future__ import annotations

import json

import pytest
import torch

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
        with_kv = entry["bound_with_kv_new_tokens_per_s"]
        assert 0 < with_kv < entry["bound_new_tokens_per_s"]
        assert entry["ours_pct_of_bound_with_kv"] == round(100 * ours / with_kv, 1)
        decode = entry["ours"]["decode_new_tokens_per_s"]
        assert entry["ours_decode_pct_of_bound_with_kv"] == round(100 * decode / with_kv, 1)
        assert entry["recompile_limit_hits"] == []
        assert not [w for w in entry["warnings"] if w.startswith("ppo_core")]
        assert result["summary"][name]["ours_new_tokens_per_s"] == ours
        assert ("graph_breaks" in entry["ours"]) == (name in rollout_families.COMPILED_FORWARD)
        if name in rollout_families.NO_REFERENCE:
            assert "hf_static" not in entry and "ours_over_hf_static" not in entry
            continue
        assert entry["hf_static"]["new_tokens"] == 2 * 4
        assert entry["ours_over_hf_static"] == round(ours / entry["hf_static"]["new_tokens_per_s"], 2)
        assert entry["hf_static_pct_of_bound_with_kv"] == round(
            100 * entry["hf_static"]["new_tokens_per_s"] / with_kv, 1
        )
    # the same fields derived afterwards from the result's own numbers (as for a result measured without them)
    kv_fields = ("bound_with_kv_new_tokens_per_s", "ours_pct_of_bound_with_kv", "kv_gib_per_step")
    stripped = {
        key: {k: v for k, v in value.items() if k not in kv_fields} if key in paths else value
        for key, value in result.items()
    }
    derived = rollout_families.add_kv_bound(stripped)
    for name in paths:
        assert derived[name]["bound_with_kv_new_tokens_per_s"] == pytest.approx(
            result[name]["bound_with_kv_new_tokens_per_s"], rel=1e-5
        )
        assert derived[name]["ours_pct_of_bound_with_kv"] == pytest.approx(
            result[name]["ours_pct_of_bound_with_kv"], abs=0.1
        )


def test_kv_bytes_per_token_by_hand() -> None:
    import transformers

    qwen3 = transformers.Qwen3Config(**rollout_families.FAMILIES["qwen3"][1])
    assert rollout_families.kv_bytes_per_token(qwen3, 2) == 28 * 8 * 128 * 2 * 2  # 114,688 B
    llama = transformers.LlamaConfig(**rollout_families.FAMILIES["llama"][1])
    assert rollout_families.kv_bytes_per_token(llama, 2) == 16 * 8 * 64 * 2 * 2  # 32,768 B
    # GPT-NeoX: no key-value heads of its own, head_dim = hidden / heads = 256
    neox = transformers.GPTNeoXConfig(**rollout_families.FAMILIES["neox"][1])
    assert rollout_families.kv_bytes_per_token(neox, 4) == 16 * 8 * 256 * 2 * 4


def test_kv_bytes_per_decode_step_by_hand() -> None:
    # 3 rows, prompt 5, 3 new tokens: cached lengths 5, 6, 7 (mean 6) of 10 bytes a position
    assert rollout_families.kv_bytes_per_decode_step(10, batch=3, prompt=5, new=3) == 10 * 3 * 6
    # one new token: the prompt's length only
    assert rollout_families.kv_bytes_per_decode_step(7, batch=2, prompt=4, new=1) == 7 * 2 * 4


def test_add_bounds_by_hand() -> None:
    entry = {"ours": {"new_tokens_per_s": 1.0, "decode_new_tokens_per_s": 4.0}}
    rollout_families.add_bounds(entry, batch=4, bandwidth=100.0, weight_bytes=50, kv_bytes=150.0)
    # weights only: 4 rows x 100 B/s / 50 B = 8 tokens/s; with the cache: 4 x 100 / 200 = 2
    assert entry["bound_new_tokens_per_s"] == 8.0 and entry["bound_with_kv_new_tokens_per_s"] == 2.0
    assert entry["ours_pct_of_bound"] == 12.5 and entry["ours_pct_of_bound_with_kv"] == 50.0
    assert entry["ours_decode_pct_of_bound"] == 50.0 and entry["ours_decode_pct_of_bound_with_kv"] == 200.0
    assert not any(key.startswith("hf_static") for key in entry)


def test_add_kv_bound_on_a_result_of_the_qwen3_shape() -> None:
    import torch

    model = rollout_families.build("qwen3", torch.device("meta"), torch.bfloat16, tiny=False)
    weights = rollout_families.weight_bytes(model)
    case = {"batch": 64, "prompt": 256, "new": 128}
    result = {
        "dtype": "bfloat16",
        "case": case,
        "qwen3": {"bound_new_tokens_per_s": 64 * 3e12 / weights, "ours": {"new_tokens_per_s": 1e4}},
    }
    derived = rollout_families.add_kv_bound(result)
    kv = 28 * 8 * 128 * 2 * 2 * 64 * (256 + 127 / 2)  # about twice the weights' bytes
    assert 1.9 < kv / weights < 2.1
    bound = 64 * 3e12 / (weights + kv)
    assert derived["qwen3"]["bound_with_kv_new_tokens_per_s"] == round(bound, 1)
    assert derived["qwen3"]["ours_pct_of_bound_with_kv"] == round(100 * 1e4 / bound, 1)
    assert derived["summary"]["qwen3"]["ours_pct_of_bound_with_kv"] == round(100 * 1e4 / bound, 1)
    assert "--add-kv-bound" in derived["note"] and "bound_with_kv_new_tokens_per_s" not in result["qwen3"]


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


def test_timed_calls_follow_the_untimed_warm_up_calls() -> None:
    """The engine's first call captures its graph after the first step and its second during the prefill: neither
    is timed."""
    calls = []
    times, out, warmup = rollout_families._timed(
        lambda: calls.append(len(calls)) or len(calls), 3, torch.device("cpu")
    )
    assert rollout_families.WARMUP_CALLS == 2
    assert len(calls) == rollout_families.WARMUP_CALLS + 3
    assert len(times) == 3 and out == len(calls) and warmup >= 0
