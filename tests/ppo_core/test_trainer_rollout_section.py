"""The trainer config's one rollout section: ``PPOConfig`` reads the sampling at ``rollout.<key>`` (next to ``n``),
as a job does; the old ``actor.worker.rollout.<key>`` is a deprecated alias that gives the same config, and the
actor worker samples with the section's settings."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core._config_base import ConfigBase
from ppo_core.rollout import SamplingConfig
from ppo_core.trainer import aliases
from ppo_core.trainer.config import ActorConfig, PPOConfig, RolloutConfig
from ppo_core.workers.torch import TorchActorConfig

SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(1, 4096),
        "temperature": st.sampled_from([0.0, 0.3, 1.0, 1.7]),
        "top_p": st.sampled_from([0.5, 0.9, 1.0]),
        "top_k": st.integers(0, 50),
        "eos_token_id": st.none() | st.integers(0, 1000),
        "pad_token_id": st.integers(0, 1000),
        "use_cache": st.booleans(),
        "batch_invariant": st.booleans(),
        "engine": st.sampled_from(["auto", "reference", "hf"]),
    },
).filter(  # the batch-invariant sampler needs a cached engine that has one (refused when the config is built)
    lambda s: not s.get("batch_invariant") or (s.get("engine") != "reference" and s.get("use_cache", True))
)


@given(sampling=SAMPLING, n=st.integers(1, 8))
def test_the_old_layout_gives_the_config_of_the_one_rollout_section(sampling: dict, n: int) -> None:
    old = PPOConfig.from_dict({"actor": {"worker": {"rollout": dict(sampling)}}, "rollout": {"n": n}})
    new = PPOConfig.from_dict({"rollout": {"n": n, **sampling}})
    assert old == new
    assert new.rollout.n == n and all(getattr(new.rollout, k) == v for k, v in sampling.items())
    # the actor worker samples with the section's settings (a dict worker gets them where they are not the defaults)
    expected = SamplingConfig(**sampling)
    given_worker = new.actor.worker.get("rollout")
    assert (given_worker is None) == (expected == SamplingConfig())
    assert given_worker is None or SamplingConfig.from_dict(given_worker) == expected
    assert PPOConfig.from_dict(new.to_dict()) == new  # the sampling at rollout only
    assert "rollout" not in new.to_dict()["actor"]["worker"]


@given(sampling=SAMPLING, n=st.integers(1, 8))
def test_typed_workers_in_either_layout_give_one_config(sampling: dict, n: int) -> None:
    worker = TorchActorConfig(ppo_mini_batch_size=n, rollout=SamplingConfig(**sampling))
    old = PPOConfig(actor=ActorConfig(worker=worker), rollout=RolloutConfig(n=n))
    new = PPOConfig(
        actor=ActorConfig(worker=TorchActorConfig(ppo_mini_batch_size=n)),
        rollout=RolloutConfig(n=n, **sampling),
    )
    assert old == new and old.actor.worker.rollout == new.rollout.sampling_fields() == SamplingConfig(
        **sampling
    )
    assert worker.rollout == SamplingConfig(**sampling)  # the caller's worker config is not modified


def test_a_conflict_names_both_keys() -> None:
    with pytest.raises(
        ValueError, match=re.escape("actor.worker.rollout.temperature=0.5 (deprecated) and rollout")
    ):
        PPOConfig.from_dict(
            {"actor": {"worker": {"rollout": {"temperature": 0.5}}}, "rollout": {"temperature": 0.7}}
        )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "actor.worker.rollout.max_new_tokens=9 (deprecated) and rollout.max_new_tokens=8 are both set and differ"
        ),
    ):
        PPOConfig(
            actor=ActorConfig(
                worker=TorchActorConfig(ppo_mini_batch_size=8, rollout=SamplingConfig(max_new_tokens=9))
            ),
            rollout=RolloutConfig(max_new_tokens=8),
        )
    # the same value twice is one setting
    same = PPOConfig.from_dict(
        {"actor": {"worker": {"rollout": {"temperature": 0.5}}}, "rollout": {"temperature": 0.5}}
    )
    assert same.rollout.temperature == 0.5


def test_an_old_section_merges_with_the_canonical_one_key_by_key() -> None:
    tree = {
        "actor": {"worker": {"rollout": {"engine": "hf", "engine_config": {"check_every": 4}}}},
        "rollout": {"engine_config": {"kv_bucket": 32}},
    }
    assert aliases.canonical_tree(tree, warn=False) == {
        "actor": {"worker": {}},
        "rollout": {"engine": "hf", "engine_config": {"kv_bucket": 32, "check_every": 4}},
    }
    tree["rollout"]["engine_config"]["check_every"] = 8
    with pytest.raises(
        ValueError, match=r"^actor\.worker\.rollout\.engine_config\.check_every=4 \(deprecated\)"
    ):
        aliases.canonical_tree(tree, warn=False)


def test_the_old_key_warns_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aliases, "_warned", set())
    tree = {"actor": {"worker": {"rollout": {"top_k": 5}}}}
    snapshot = copy.deepcopy(tree)
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.aliases"):
        PPOConfig.from_dict(tree)
        PPOConfig.from_dict(tree)
        PPOConfig.from_dict({"rollout": {"top_k": 5}})
    assert [r.getMessage() for r in caplog.records] == [
        "actor.worker.rollout.top_k is deprecated: write rollout.top_k (the old key is read as an alias for one "
        "release)"
    ]
    assert tree == snapshot


def test_a_custom_worker_without_sampling_keeps_its_config() -> None:
    cfg = PPOConfig.from_dict({"actor": {"worker": {"my_key": 1}}})
    assert cfg.actor.worker == {"my_key": 1}

    @dataclasses.dataclass(kw_only=True)
    class MyWorkerConfig(ConfigBase):
        rollout: str = "mine"
        """Not a sampling config: left alone."""

    mine = MyWorkerConfig()
    assert (
        PPOConfig(actor=ActorConfig(worker=mine), rollout=RolloutConfig(temperature=0.5)).actor.worker is mine
    )
    with pytest.raises(
        ValueError, match=r"^actor\.worker\.rollout: unknown SamplingConfig field\(s\) \['bogus'\]"
    ):
        PPOConfig(actor=ActorConfig(worker={"rollout": {"bogus": 1}}))
