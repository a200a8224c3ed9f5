"""Sampling settings are checked once: in the typed sampling config, when it is built. From a job's YAML keys to
the decode loop, ``max_new_tokens`` is then handed on as the typed config (or its field), never checked again; and
every error a user can hit still appears, once (the message names the key one time)."""

from __future__ import annotations

import functools

import pytest
import torch
from _hf import tiny_llama
from tensordict import TensorDict

from ppo_core.rollout import SamplingConfig, generate, sampling
from ppo_core.workers.torch import TorchActorWorker
from ppo_core_cli.loading import load_job_config

transformers = pytest.importorskip("transformers")

VOCAB = 29


_llama = functools.partial(tiny_llama, VOCAB)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``max_new_tokens`` of every sampling config whose checks ran (``SamplingConfig.__post_init__``)."""
    seen: list[int] = []
    original = sampling.SamplingConfig.__post_init__

    def counted(self: SamplingConfig) -> None:
        seen.append(self.max_new_tokens)
        original(self)

    monkeypatch.setattr(sampling.SamplingConfig, "__post_init__", counted)
    return seen


@pytest.mark.parametrize("engine", ["hf", "reference"])
def test_max_new_tokens_is_checked_once_from_the_job_to_the_decode_loop(
    checks: list[int], engine: str
) -> None:
    job = load_job_config(
        None, ["rollout.max_new_tokens=7", f"rollout.engine={engine}", "actor.worker.ppo_mini_batch_size=8"]
    )
    actor_cfg, _ = job.resolved_workers("/unused", eos_token_id=None, pad_token_id=0)
    worker = TorchActorWorker(_llama, actor_cfg)
    prompts = torch.tensor([[0, 3, 4], [5, 6, 7]])
    batch = TensorDict({"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}, batch_size=[2])
    for _ in range(2):
        assert worker.generate_sequences(batch)["responses"].shape == (2, 7)
    assert actor_cfg.rollout.max_new_tokens == 7
    assert checks.count(7) == 1, checks  # the job's rollout section, once; the worker and engines read it


def test_a_bad_max_new_tokens_is_one_error_naming_the_key() -> None:
    with pytest.raises(ValueError) as err:
        load_job_config(None, ["rollout.max_new_tokens=0"])
    assert str(err.value) == "rollout.max_new_tokens must be >= 1, got 0"
    from ppo_core.trainer.config import PPOConfig

    # a trainer config, in either layout (the old key is moved onto the canonical one first)
    for data in (
        {"rollout": {"n": 2, "max_new_tokens": 0}},
        {"actor": {"worker": {"rollout": {"max_new_tokens": 0}}}, "rollout": {"n": 2}},
    ):
        with pytest.raises(ValueError) as err:
            PPOConfig.from_dict(data)
        assert str(err.value) == "rollout.max_new_tokens must be >= 1, got 0"


def test_the_errors_at_sampling_time_still_appear() -> None:
    lm = _llama()
    prompts, mask = torch.tensor([[0, 3, 4]]), torch.ones(1, 3)
    for engine in ("hf", "reference"):
        cfg = SamplingConfig(max_new_tokens=2, engine=engine)
        with pytest.raises(ValueError, match=r"^generator is required when temperature > 0"):
            generate(lm, prompts, mask, cfg)
        bad_eos = SamplingConfig(max_new_tokens=2, temperature=0, eos_token_id=VOCAB, engine=engine)
        with pytest.raises(ValueError, match=r"^config\.eos_token_id"):
            generate(lm, prompts, mask, bad_eos)
        with pytest.raises(TypeError, match=r"^prompts"):
            generate(lm, [[0, 3, 4]], mask, SamplingConfig(max_new_tokens=2, temperature=0, engine=engine))
    # the decoder's keyword form checks its settings through the same config, once
    from ppo_core_decode.hf import HFRolloutEngine

    decoder = HFRolloutEngine(lm).decoder
    with pytest.raises(ValueError, match=r"^max_new_tokens must be >= 1, got 0$"):
        decoder.generate(prompts, mask, max_new_tokens=0, temperature=0.0)
    with pytest.raises(ValueError, match=r"^top_p must be in"):
        decoder.generate(prompts, mask, max_new_tokens=1, temperature=0.0, top_p=2.0)
    with pytest.raises(ValueError, match=r"^eos_token_id"):
        decoder.generate(prompts, mask, max_new_tokens=1, temperature=0.0, eos_token_id=-1)


def test_sampling_fields_and_special_tokens_hand_on_the_checked_values() -> None:
    from ppo_core_cli.roles import JobRolloutConfig

    section = JobRolloutConfig(
        n=4, max_new_tokens=9, temperature=0.5, engine="hf", engine_config={"kv_bucket": 32}
    )
    out = section.sampling(eos_token_id=3, pad_token_id=1)
    assert type(out) is SamplingConfig and out == SamplingConfig(
        max_new_tokens=9,
        temperature=0.5,
        eos_token_id=3,
        pad_token_id=1,
        engine="hf",
        engine_config={"kv_bucket": 32},
    )
    assert (
        JobRolloutConfig(eos_token_id=5, pad_token_id=6).sampling(eos_token_id=3, pad_token_id=1).eos_token_id
        == 5
    )
    with pytest.raises(TypeError, match=r"^pad_token_id must be an int"):
        SamplingConfig().with_special_tokens(eos_token_id=None, pad_token_id="0")  # type: ignore[arg-type]
    assert functools.reduce(lambda c, _: c.sampling_fields(), range(3), out) == out


@pytest.mark.parametrize("keys", [{"engine": "reference"}, {"use_cache": False}])
def test_batch_invariant_with_the_generic_loop_is_refused_when_the_config_is_built(keys) -> None:
    # the generic loop refuses batch_invariant at every step; a job learns it before any model loads
    with pytest.raises(ValueError, match=r"^batch_invariant=True needs the hf engine"):
        SamplingConfig(batch_invariant=True, **keys)
    with pytest.raises(ValueError, match=r"^rollout\.batch_invariant=True needs the hf engine"):
        load_job_config(
            None, ["rollout.batch_invariant=true", *(f"rollout.{k}={v}" for k, v in keys.items())]
        )
    assert SamplingConfig(**keys).batch_invariant is False
    assert SamplingConfig(batch_invariant=True, engine="hf").batch_invariant
