"""Timer (with a fake clock), per-token timing metrics and throughput against hand-derived oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.metrics import (
    ALL_TOKEN_TIMERS,
    RESPONSE_TOKEN_TIMERS,
    Timer,
    compute_throughput_metrics,
    compute_timing_metrics,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_nests_accumulates_and_records_on_error():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer("step"):
        clock.now += 1.0
        with timer("gen"):
            clock.now += 2.0
        with timer("gen"):
            clock.now += 0.5
        with pytest.raises(RuntimeError), timer("update_actor"):
            clock.now += 4.0
            raise RuntimeError("boom")
    assert timer.times == {"gen": 2.5, "update_actor": 4.0, "step": 7.5}
    assert timer.reset() == {"gen": 2.5, "update_actor": 4.0, "step": 7.5}
    assert timer.times == {}


def test_timer_rejects_reentering_an_open_name():
    timer = Timer(clock=FakeClock())
    with timer("step"), pytest.raises(ValueError, match="timer 'step' is already running"), timer("step"):
        pass
    with pytest.raises(ValueError, match="name must be a non-empty str"), timer(""):
        pass


@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=5),
    st.integers(1, 6),
    st.integers(0, 3),
    st.dictionaries(
        st.sampled_from(["gen", "ref", "values", "adv", "update_actor", "step", "reward"]),
        st.floats(0, 100),
        max_size=7,
    ),
)
def test_timing_metrics_match_token_count_oracle(resp_lens, width, prompt_width, timing):
    size = len(resp_lens)
    resp_lens = [min(n, width) for n in resp_lens]
    prompt_lens = [i % (prompt_width + 1) for i in range(size)]
    attn = [
        [1] * p + [0] * (prompt_width - p) + [1] * r + [0] * (width - r)
        for p, r in zip(prompt_lens, resp_lens, strict=True)
    ]
    batch = TensorDict(
        {
            "response_mask": torch.tensor(resp_lens)[:, None] > torch.arange(width),
            "attention_mask": torch.tensor(attn, dtype=torch.int64).reshape(size, prompt_width + width),
        },
        batch_size=[size],
    )
    got = compute_timing_metrics(batch, timing)
    want = {f"timing_s/{k}": v for k, v in timing.items()}
    for name, seconds in timing.items():
        tokens = sum(resp_lens) if name in RESPONSE_TOKEN_TIMERS else sum(resp_lens) + sum(prompt_lens)
        if name in RESPONSE_TOKEN_TIMERS or name in ALL_TOKEN_TIMERS:
            want[f"timing_per_token_ms/{name}"] = 1000 * seconds / tokens if tokens else 0.0
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key]), key


def test_verl_timing_example():
    """verl's test: gen uses response tokens (0.5 s / 6 tokens), ref uses all tokens (/12)."""
    batch = TensorDict(
        {"response_mask": torch.ones(2, 3), "attention_mask": torch.ones(2, 6)}, batch_size=[2]
    )
    got = compute_timing_metrics(batch, {"gen": 0.5, "ref": 0.5})
    assert got["timing_per_token_ms/gen"] == pytest.approx(500 / 6)
    assert got["timing_per_token_ms/ref"] == pytest.approx(500 / 12)
    empty = TensorDict({"response_mask": torch.zeros(2, 3)}, batch_size=[2])
    assert compute_timing_metrics(empty, {"gen": 0.5}) == {
        "timing_s/gen": 0.5,
        "timing_per_token_ms/gen": 0.0,
    }


def test_throughput():
    batch = TensorDict(
        {"response_mask": torch.ones(2, 200), "attention_mask": torch.ones(2, 300)}, batch_size=[2]
    )
    assert compute_throughput_metrics(batch, {"step": 2.0}, n_gpus=1)["perf/throughput"] == 300.0
    out = compute_throughput_metrics(batch, {"step": 2.0}, n_gpus=2)
    assert out == {"perf/total_num_tokens": 600.0, "perf/time_per_step": 2.0, "perf/throughput": 150.0}
    assert compute_throughput_metrics(batch, {"step": 0.0}, n_gpus=2)["perf/throughput"] == 0.0
    with pytest.raises(KeyError, match=r"timing has no 'step' entry; it has \['gen'\]"):
        compute_throughput_metrics(batch, {"gen": 1.0}, n_gpus=1)
    with pytest.raises(ValueError, match="n_gpus must be an int >= 1"):
        compute_throughput_metrics(batch, {"step": 1.0}, n_gpus=0)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        compute_throughput_metrics(
            TensorDict({"response_mask": torch.ones(2, 5), "attention_mask": torch.ones(2, 3)}, [2]),
            {"step": 1.0},
            1,
        )
