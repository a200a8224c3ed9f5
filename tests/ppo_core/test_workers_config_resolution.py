"""A worker config in a run: checked before the checkpoint is known (``unresolved``), completed from it
(``resolved``), the data-parallel size of a group, the keys a job writes (``job_keys``), and ``worker_setting``."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_core.trainer.config import worker_setting
from ppo_core.workers.config import ModelSource
from ppo_core.workers.megatron.config import (
    MEGATRON_SHAPE_KEYS,
    MegatronActorConfig,
    MegatronCriticConfig,
)
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig


def test_torch_configs_take_only_their_checkpoint_from_the_run():
    """The torch workers load their models through their factories; the run records the checkpoint they start from
    (``hf_checkpoint``, compared when a run resumes), which a job may not set."""
    cfg = TorchActorConfig.unresolved({"ppo_mini_batch_size": 4})
    assert cfg == TorchActorConfig(ppo_mini_batch_size=4) and TorchActorConfig.RUN_KEYS == ("hf_checkpoint",)
    resolved = cfg.resolved(ModelSource(checkpoint="/m", dtype="bfloat16"))
    assert resolved == dataclasses.replace(cfg, hf_checkpoint="/m") and cfg.hf_checkpoint is None
    assert (
        resolved.job_keys()
        == cfg.job_keys()
        == {k: v for k, v in cfg.to_dict().items() if k != "hf_checkpoint"}
    )
    assert cfg.data_parallel_size(3) == 3
    with pytest.raises(ValueError, match="hf_checkpoint is set by the run from the model's checkpoint"):
        TorchActorConfig.unresolved({"hf_checkpoint": "/x"})
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        cfg.data_parallel_size(0)


def test_the_torch_actor_refuses_the_megatron_rollout_engine():
    with pytest.raises(
        ValueError, match=r"^rollout\.engine='megatron' samples with the megatron actor's policy"
    ):
        TorchActorConfig.from_dict({"rollout": {"engine": "megatron"}})


def test_the_torch_actor_checks_exact_log_probs_and_the_engine_both():
    # both checks of TorchActorConfig run (a second __post_init__ once hid the first)
    with pytest.raises(ValueError, match=r"^exact_log_probs=True needs the batch-invariant sampler"):
        TorchActorConfig.from_dict({"exact_log_probs": True})
    cfg = TorchActorConfig.from_dict({"exact_log_probs": True, "rollout": {"batch_invariant": True}})
    assert cfg.exact_log_probs and cfg.rollout.batch_invariant


@pytest.mark.parametrize("cls", [MegatronActorConfig, MegatronCriticConfig])
def test_megatron_configs_refuse_the_keys_the_run_sets(cls):
    for key in cls.RUN_KEYS:
        head, _, tail = key.partition(".")
        data = {head: {tail: 1}} if tail else {head: 1}
        with pytest.raises(ValueError, match=rf"^{key} is set by the run from the model's checkpoint"):
            cls.unresolved(data)
    cfg = cls.unresolved({"model": {"attention": "local"}, "parallel": {"tensor_model_parallel_size": 2}})
    assert cfg.model.attention == "local" and cfg.data_parallel_size(4) == 2
    written = cfg.job_keys()
    assert not set(MEGATRON_SHAPE_KEYS) & set(written["model"]) and "hf_checkpoint" not in written
    assert cls.unresolved(written) == cfg  # what a job writes reads back as the same config
    with pytest.raises(ValueError, match=r"^parallel: world_size \(3\) must be divisible"):
        cfg.data_parallel_size(3)


def test_megatron_configs_take_the_shape_of_the_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf.save_pretrained(tmp_path)
    source = ModelSource(checkpoint=str(tmp_path), dtype="float32", value_head_init_std=0.02, seed=7)
    actor = MegatronActorConfig.unresolved({"model": {"attention": "local", "seed": 3}}).resolved(source)
    m = actor.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.kv_heads) == (3, 32, 48, 96, 2)
    assert (m.dtype, m.attention, m.seed, m.qkv_bias) == ("float32", "local", 3, True)  # the job's keys kept
    assert actor.hf_checkpoint == str(tmp_path)
    critic = MegatronCriticConfig.unresolved({}).resolved(source)
    assert (critic.value_head_init_std, critic.value_head_seed, critic.model.num_layers) == (0.02, 7, 3)


def test_worker_setting_reads_a_dict_or_a_typed_config():
    assert worker_setting({"ppo_mini_batch_size": 4}, "ppo_mini_batch_size") == 4
    assert worker_setting({}, "ppo_mini_batch_size") is None
    assert worker_setting(TorchCriticConfig(ppo_mini_batch_size=8), "ppo_mini_batch_size") == 8
    assert worker_setting(TorchCriticConfig(), "use_kl_loss") is None  # a critic has no such field


def test_torch_actor_config_runs_every_check():
    """Both of the torch actor's own checks run (one ``__post_init__``: a second definition would hide the first)."""
    from ppo_core.workers.torch import TorchActorConfig

    with pytest.raises(ValueError, match=r"^exact_log_probs=True needs the batch-invariant sampler"):
        TorchActorConfig.from_dict({"exact_log_probs": True})
    with pytest.raises(ValueError, match=r"^rollout\.engine='megatron'"):
        TorchActorConfig.from_dict({"rollout": {"engine": "megatron"}})
    assert TorchActorConfig.from_dict(
        {"exact_log_probs": True, "rollout": {"batch_invariant": True}}
    ).exact_log_probs
