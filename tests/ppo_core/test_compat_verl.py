"""ppo_config_from_verl: verl's defaults, each key in its place, unit changes, and one error for every unmappable key.

The verl values below are verl's documented defaults and semantics (its ``ppo_trainer.yaml``), written out by hand.
"""

from __future__ import annotations

import logging
import os
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("omegaconf")

from ppo_core.compat import convert_verl, ppo_config_from_verl
from ppo_core.compat._verl_defaults import DEFAULTS, MEGATRON_DEFAULTS, composed_config, nested
from ppo_core.compat._verl_keys import IGNORED, REFUSED, RULES, STRUCTURAL, Ref
from ppo_core.losses import PolicyLossConfig
from ppo_core.trainer.config import PPOConfig
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

# at most 60 examples under the ci profile (the dev profile's 30 stay 30): each example is slow, and the suite
# must stay within its 10-minute budget on the 2-core CI machine
_CI_EXAMPLES = min(60, settings.default.max_examples)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migrating-from-verl.md"


def _verl(**sections) -> dict:
    """A nested verl config from ``section={"dotted.key": value}`` keyword arguments."""
    out: dict = {}
    for section, values in sections.items():
        for key, value in values.items():
            node = out.setdefault(section, {})
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return out


def test_empty_config_gives_verls_defaults():
    cfg = ppo_config_from_verl({})
    assert isinstance(cfg, PPOConfig)
    actor, critic = cfg.actor.worker, cfg.critic.worker
    assert cfg.data.train_batch_size == 1024 and cfg.data.shuffle is True
    assert cfg.actor.world_size == cfg.critic.world_size == 8  # 1 node x 8 GPUs
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.gamma == 1.0 and cfg.algorithm.lam == 1.0
    assert cfg.use_critic and not cfg.use_reference
    assert actor["optim"]["lr"] == 1e-6 and critic["optim"]["lr"] == 1e-5
    assert actor["optim"]["grad_clip"] == 1.0 and actor["optim"]["weight_decay"] == 0.01
    assert actor["ppo_mini_batch_size"] == 256 and critic["ppo_mini_batch_size"] == 256
    assert actor["seed"] == 42 and actor["kl_loss_type"] == "low_var_kl" and actor["use_reference"] is False
    loss = PolicyLossConfig.from_dict(actor["policy_loss"])
    assert (loss.eps_low, loss.eps_high, loss.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert cfg.rollout.max_new_tokens == 512 and cfg.rollout.temperature == 1.0  # the one rollout section
    assert actor["rollout"]["max_new_tokens"] == 512  # handed to the actor worker (not verl's defaults)
    assert cfg.trainer.total_epochs == 30
    assert cfg.trainer.test_freq == 0 and cfg.trainer.save_freq == 0  # verl's -1 (off)
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.trainer.loggers == ("console", "wandb")  # verl's default trackers, both kept
    TorchActorConfig.from_dict(actor)
    TorchCriticConfig.from_dict(critic)


def test_a_grpo_config_lands_in_place():
    cfg = ppo_config_from_verl(
        _verl(
            data={"train_batch_size": 64, "max_response_length": 100, "seed": 7, "shuffle": False},
            algorithm={"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False},
            actor_rollout_ref={
                "actor.ppo_mini_batch_size": 16,
                "actor.ppo_micro_batch_size_per_gpu": 4,
                "actor.ppo_epochs": 2,
                "actor.clip_ratio_low": 0.2,
                "actor.clip_ratio_high": 0.28,
                "actor.loss_agg_mode": "seq-mean-token-mean",
                "actor.policy_loss.loss_mode": "gspo",
                "actor.entropy_coeff": 0.001,
                "actor.use_kl_loss": True,
                "actor.kl_loss_coef": 0.01,
                "actor.kl_loss_type": "k3",
                "actor.optim.lr": 3e-6,
                "actor.optim.betas": [0.9, 0.95],
                "rollout.n": 5,
                "rollout.temperature": 0.7,
                "rollout.top_p": 0.9,
                "rollout.log_prob_micro_batch_size_per_gpu": 8,
                "rollout.val_kwargs.n": 3,
                "rollout.val_kwargs.do_sample": True,
                "rollout.val_kwargs.temperature": 0.7,
                "rollout.val_kwargs.top_p": 0.9,
            },
            trainer={"nnodes": 2, "n_gpus_per_node": 4, "total_epochs": 3, "save_freq": 10, "test_freq": 5},
        )
    )
    actor = cfg.actor.worker
    assert (cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle) == (64, 7, False)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert not cfg.use_critic and cfg.use_reference and cfg.actor.use_kl_loss
    assert actor["ppo_mini_batch_size"] == 16 * 5 and actor["micro_batch_size"] == 4
    assert actor["forward_micro_batch_size"] == 8 and actor["ppo_epochs"] == 2
    loss = PolicyLossConfig.from_dict(actor["policy_loss"])
    assert (loss.loss_mode, loss.loss_agg_mode, loss.eps_low, loss.eps_high) == (
        "gspo",
        "seq-mean-token-mean",
        0.2,
        0.28,
    )
    assert (actor["entropy_coeff"], actor["kl_loss_coef"], actor["kl_loss_type"]) == (0.001, 0.01, "k3")
    assert actor["use_kl_loss"] is True and actor["use_reference"] is True
    assert actor["optim"]["lr"] == 3e-6 and TorchActorConfig.from_dict(actor).optim.betas == (0.9, 0.95)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == (0.7, 0.9, 100)
    assert actor["rollout"] == cfg.rollout.sampling_fields().to_dict()  # what the actor worker samples with
    assert (cfg.rollout.n, cfg.rollout.val_n, cfg.rollout.val_do_sample) == (5, 3, True)
    assert cfg.actor.world_size == 8
    assert (cfg.trainer.total_epochs, cfg.trainer.save_freq, cfg.trainer.test_freq) == (3, 10, 5)
    TorchActorConfig.from_dict(actor)


def test_mini_batches_count_responses_and_the_critic_follows_the_actor():
    cfg = ppo_config_from_verl(_verl(actor_rollout_ref={"actor.ppo_mini_batch_size": 8, "rollout.n": 4}))
    assert cfg.actor.worker["ppo_mini_batch_size"] == 32 and cfg.critic.worker["ppo_mini_batch_size"] == 32
    cfg = ppo_config_from_verl(
        _verl(actor_rollout_ref={"rollout.n": 2, "actor.ppo_epochs": 3}, critic={"ppo_mini_batch_size": 4})
    )
    assert cfg.critic.worker["ppo_mini_batch_size"] == 8 and cfg.critic.worker["ppo_epochs"] == 3


def test_global_micro_batch_sizes_are_divided_by_the_gpus():
    cfg = ppo_config_from_verl(
        _verl(
            actor_rollout_ref={"actor.ppo_micro_batch_size": 16, "rollout.log_prob_micro_batch_size": 32},
            critic={"ppo_micro_batch_size": 8},
        )
    )
    assert cfg.actor.worker["micro_batch_size"] == 2 and cfg.actor.worker["forward_micro_batch_size"] == 4
    assert cfg.critic.worker["micro_batch_size"] == 1 and cfg.critic.worker["forward_micro_batch_size"] == 1
    with pytest.raises(ValueError, match=r"ppo_micro_batch_size=12 is not divisible by the 8 GPUs"):
        ppo_config_from_verl(_verl(actor_rollout_ref={"actor.ppo_micro_batch_size": 12}))


def test_clip_ratio_alone_keeps_verls_bounds():
    """In verl, clip_ratio_low/high default to 0.2 themselves: clip_ratio alone does not move them."""
    cfg = ppo_config_from_verl(_verl(actor_rollout_ref={"actor.clip_ratio": 0.3}))
    loss = PolicyLossConfig.from_dict(cfg.actor.worker["policy_loss"])
    assert (loss.eps_low, loss.eps_high) == (0.2, 0.2)
    cfg = ppo_config_from_verl(
        _verl(
            actor_rollout_ref={
                "actor.clip_ratio": 0.3,
                "actor.clip_ratio_low": None,
                "actor.clip_ratio_high": None,
            }
        )
    )
    loss = PolicyLossConfig.from_dict(cfg.actor.worker["policy_loss"])
    assert (loss.eps_low, loss.eps_high) == (0.3, 0.3)  # verl's fallback when they are null


def test_grad_clip_of_both_spellings():
    get = lambda cfg: cfg.actor.worker["optim"]["grad_clip"]  # noqa: E731
    assert get(ppo_config_from_verl(_verl(actor_rollout_ref={"actor.grad_clip": 0.5}))) == 0.5
    assert get(ppo_config_from_verl(_verl(actor_rollout_ref={"actor.optim.clip_grad": 2.0}))) == 2.0
    same = {"actor.grad_clip": 3.0, "actor.optim.clip_grad": 3.0}
    assert get(ppo_config_from_verl(_verl(actor_rollout_ref=same))) == 3.0
    with pytest.raises(ValueError, match=r"actor\.grad_clip=0\.5: disagrees with .*optim\.clip_grad=2\.0"):
        ppo_config_from_verl(_verl(actor_rollout_ref={"actor.grad_clip": 0.5, "actor.optim.clip_grad": 2.0}))


def test_seq_mean_token_sum_norm_gets_verls_padded_width():
    cfg = ppo_config_from_verl(
        _verl(
            data={"max_response_length": 300},
            actor_rollout_ref={"actor.loss_agg_mode": "seq-mean-token-sum-norm"},
        )
    )
    assert cfg.actor.worker["loss_scale_factor"] == 300
    assert cfg.critic.worker["loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert cfg.critic.worker["loss_scale_factor"] == 300
    TorchCriticConfig.from_dict(cfg.critic.worker)
    explicit = _verl(
        actor_rollout_ref={"actor.loss_agg_mode": "seq-mean-token-sum-norm", "actor.loss_scale_factor": 64}
    )
    assert ppo_config_from_verl(explicit).actor.worker["loss_scale_factor"] == 64


def test_every_unmappable_key_is_listed_in_one_error():
    bad = _verl(
        actor_rollout_ref={
            "actor.use_dynamic_bsz": True,
            "actor.ulysses_sequence_parallel_size": 2,
            "actor.optim.lr_scheduler_type": "cosine",
            "model.lora_rank": 8,
            "rollout.top_k": 50,
            "rollout.val_kwargs.do_sample": True,
            "rollout.val_kwargs.temperature": 0.6,
        },
        algorithm={"adv_estimator": "not_an_estimator", "use_pf_ppo": True},
        trainer={"val_only": True, "resume_mode": "latest"},
        made_up={"section.key": 1},
    )
    with pytest.raises(ValueError) as err:
        ppo_config_from_verl(bad)
    message = str(err.value)
    expected = [
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.optim.lr_scheduler_type='cosine'",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.rollout.top_k=50",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "algorithm.adv_estimator='not_an_estimator'",
        "algorithm.use_pf_ppo=True",
        "trainer.val_only=True",
        "trainer.resume_mode='latest'",
        "made_up.section.key=1: not a key of verl's config",
    ]
    for key in expected:
        assert key in message, key
    assert message.startswith(f"cannot convert {len(expected)} verl config key(s)")
    assert "grpo" in message  # the valid estimators are listed


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("actor_rollout_ref", "rollout.n", "two"),
        ("trainer", "nnodes", 1.5),
        ("trainer", "n_gpus_per_node", True),
    ],
)
def test_a_value_other_rules_read_is_named_as_itself_once(section, key, value):
    """``rollout.n`` multiplies the actor's and critic's mini-batch sizes, the world size divides the micro-batch
    sizes: a value of the wrong type is reported once, under its own key, not under each key whose conversion
    read it."""
    with pytest.raises(ValueError) as err:
        ppo_config_from_verl(_verl(**{section: {key: value}}))
    message = str(err.value)
    assert f"{section}.{key}={value!r}: {section}.{key} must be an int" in message
    assert message.startswith("cannot convert 1 verl config key(s)"), message
    assert "ppo_mini_batch_size=" not in message and "micro_batch_size" not in message


def test_a_rule_across_fields_names_the_verl_keys_behind_it():
    """verl's default mini-batch (256 prompts, 1024 responses at n = 4) against 8 prompts a step: the error names
    ppo-core's keys and the verl keys (and values, defaults marked) they came from."""
    with pytest.raises(ValueError) as err:
        ppo_config_from_verl(_verl(data={"train_batch_size": 8}, actor_rollout_ref={"rollout.n": 4}))
    message = str(err.value)
    assert "actor.worker.ppo_mini_batch_size=1024 does not divide the responses of a step" in message
    assert message.endswith(
        "; from verl's actor_rollout_ref.actor.ppo_mini_batch_size=256 (verl default), "
        "actor_rollout_ref.rollout.n=4, data.train_batch_size=8"
    )


def test_ignored_keys_are_skipped():
    cfg = ppo_config_from_verl(
        _verl(
            trainer={
                "project_name": "p",
                "experiment_name": "e",
                "balance_batch": True,
                "log_val_generations": 4,
            },
            data={"train_files": "/data/train.parquet", "max_prompt_length": 1024, "prompt_key": "prompt"},
            actor_rollout_ref={
                "model.path": "/models/qwen",
                "model.enable_gradient_checkpointing": True,
                "actor.fsdp_config.param_offload": True,
                "actor.profiler.enable": True,
                "actor._target_": "verl.workers.config.FSDPActorConfig",
                "rollout.name": "vllm",
                "rollout.gpu_memory_utilization": 0.6,
                "ref.log_prob_micro_batch_size_per_gpu": 16,
                "ref.fsdp_config.param_offload": True,
                "rollout.multi_turn.max_assistant_turns": 3,
            },
            reward_model={"model.path": "/models/rm"},
            custom_reward_function={"name": "compute_score"},
            ray_kwargs={"ray_init.num_cpus": 8},
        )
    )
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"  # verl's default spelled from the names
    assert "hf_checkpoint" not in cfg.actor.worker  # the torch workers get their model from init_workers()


def test_yaml_file_with_interpolations(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        """
data:
  train_batch_size: 16
  max_response_length: 48
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: ${data.train_batch_size}
    optim:
      lr: 1e-6
  rollout:
    n: 2
    response_length: ${oc.select:data.max_response_length,512}
critic:
  ppo_epochs: ${actor_rollout_ref.actor.ppo_epochs}
"""
    )
    cfg = ppo_config_from_verl(path)
    assert cfg.actor.worker["ppo_mini_batch_size"] == 32 and cfg.actor.worker["optim"]["lr"] == 1e-6
    assert cfg.rollout.max_new_tokens == 48 and cfg.actor.worker["rollout"]["max_new_tokens"] == 48
    assert cfg.critic.worker["ppo_epochs"] == 1  # an interpolation to a key left out: verl's default
    assert ppo_config_from_verl(str(path)) == cfg
    broken = tmp_path / "broken.yaml"
    broken.write_text("data:\n  train_batch_size: ${nowhere.size}\ntrainer:\n  val_only: true\n")
    with pytest.raises(
        ValueError, match=r"(?s)cannot convert 2 .*data\.train_batch_size: cannot resolve.*val_only"
    ):
        ppo_config_from_verl(broken)


def test_bad_values_name_the_verl_key():
    with pytest.raises(
        ValueError, match=r"^verl's actor_rollout_ref\.actor\.optim\.lr=-1\.0 is not valid .*lr"
    ):
        ppo_config_from_verl(_verl(actor_rollout_ref={"actor.optim.lr": -1.0}))
    with pytest.raises(
        ValueError, match=r"^verl's algorithm\.gamma='0\.9' is not valid .*algorithm\.gamma must be"
    ):
        ppo_config_from_verl(_verl(algorithm={"gamma": "0.9"}))
    with pytest.raises(ValueError, match=r"^verl's data\.train_batch_size=0 is not valid"):
        ppo_config_from_verl(_verl(data={"train_batch_size": 0}))


def test_loggers_resume_and_frequencies():
    cfg = ppo_config_from_verl(
        _verl(
            trainer={
                "logger": ["console", "wandb", "tensorboard", "mlflow"],
                "resume_mode": "resume_path",
                "resume_from_path": "ckpt/global_step_5",
                "test_freq": 0,
                "save_freq": -1,
            }
        )
    )
    assert cfg.trainer.loggers == ("console", "wandb", "tensorboard", "jsonl")
    assert (cfg.trainer.resume_mode, cfg.trainer.resume_from_path) == ("path", "ckpt/global_step_5")
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq) == (0, 0)
    assert ppo_config_from_verl(_verl(trainer={"logger": "console"})).trainer.loggers == ("console",)


def test_dropped_trackers_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="ppo_core.compat.verl"):
        ppo_config_from_verl(_verl(trainer={"logger": ["console", "mlflow"]}))
    assert "mlflow" in caplog.text


def test_megatron_strategy_fills_the_megatron_worker_fields():
    cfg = ppo_config_from_verl(
        _verl(
            actor_rollout_ref={
                "actor.strategy": "megatron",
                "actor.megatron.tensor_model_parallel_size": 2,
                "actor.megatron.pipeline_model_parallel_size": 2,
                "model.path": "/models/llama",
            },
            critic={"strategy": "megatron", "megatron.tensor_model_parallel_size": 4},
        )
    )
    actor = cfg.actor.worker
    assert actor["parallel"] == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "context_parallel_size": 1,
        "sequence_parallel": True,  # verl's megatron defaults
    }
    assert actor["use_distributed_optimizer"] is True and actor["hf_checkpoint"] == "/models/llama"
    assert MegatronActorConfig.from_dict(actor).parallel.pipeline_model_parallel_size == 2
    assert MegatronCriticConfig.from_dict(cfg.critic.worker).parallel.tensor_model_parallel_size == 4
    fsdp = ppo_config_from_verl(_verl(actor_rollout_ref={"actor.megatron.tensor_model_parallel_size": 2}))
    assert "parallel" not in fsdp.actor.worker  # verl reads megatron.* only with the megatron strategy
    with pytest.raises(ValueError, match=r"actor\.megatron\.expert_model_parallel_size=2"):
        ppo_config_from_verl(_verl(actor_rollout_ref={"actor.megatron.expert_model_parallel_size": 2}))


def test_input_types():
    with pytest.raises(TypeError, match="cfg must be a mapping"):
        ppo_config_from_verl(3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        ppo_config_from_verl("nope.yaml")


def test_the_guide_lists_every_key():
    text = DOC.read_text()
    for rule in RULES:
        assert f"`{rule.key}`" in text, rule.key
    for pattern, _ in (*IGNORED, *REFUSED, *STRUCTURAL):
        assert f"`{pattern}`" in text, pattern


# verl key -> ppo-core path for values copied unchanged (written out here, independently of the converter's table)
PASS_THROUGH = {
    "algorithm.gamma": ("algorithm.gamma", st.floats(0, 1)),
    "algorithm.lam": ("algorithm.lam", st.floats(0, 1)),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_ctrl.kl_coef", st.floats(0, 1)),
    "algorithm.kl_ctrl.target_kl": ("algorithm.kl_ctrl.target_kl", st.floats(1e-3, 1)),
    # multiples of verl's default mini-batch (256 prompts), which must divide it (in verl too)
    "data.train_batch_size": ("data.train_batch_size", st.integers(1, 16).map(lambda k: 256 * k)),
    "actor_rollout_ref.rollout.n": ("rollout.n", st.integers(1, 16)),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", st.floats(0.1, 2)),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", st.floats(0.01, 1)),
    "actor_rollout_ref.rollout.response_length": (
        "rollout.max_new_tokens",
        st.integers(1, 4096),
    ),
    "actor_rollout_ref.actor.entropy_coeff": ("actor.worker.entropy_coeff", st.floats(0, 0.1)),
    "actor_rollout_ref.actor.kl_loss_coef": ("actor.worker.kl_loss_coef", st.floats(0, 1)),
    "actor_rollout_ref.actor.clip_ratio_high": ("actor.worker.policy_loss.clip_ratio_high", st.floats(0, 1)),
    "actor_rollout_ref.actor.ppo_epochs": ("actor.worker.ppo_epochs", st.integers(1, 8)),
    "actor_rollout_ref.actor.optim.lr": ("actor.worker.optim.lr", st.floats(1e-8, 1e-3)),
    "critic.optim.lr": ("critic.worker.optim.lr", st.floats(1e-8, 1e-3)),
    "critic.cliprange_value": ("critic.worker.cliprange_value", st.floats(0.01, 10)),
    "trainer.total_epochs": ("trainer.total_epochs", st.integers(1, 100)),
    "trainer.critic_warmup": ("trainer.critic_warmup", st.integers(0, 10)),
}


def _get(cfg: PPOConfig, path: str):
    node = cfg.to_dict()
    for part in path.split("."):
        node = node[part]
    return node


@settings(max_examples=_CI_EXAMPLES)
@given(
    st.dictionaries(st.sampled_from(sorted(PASS_THROUGH)), st.none(), min_size=1).flatmap(
        lambda keys: st.fixed_dictionaries({k: PASS_THROUGH[k][1] for k in keys})
    )
)
def test_values_are_copied_to_their_place(values):
    cfg = ppo_config_from_verl(nested(values))
    for key, value in values.items():
        assert _get(cfg, PASS_THROUGH[key][0]) == value, key


def test_plain_dicts_need_no_omegaconf(monkeypatch):
    import builtins

    data = _verl(algorithm={"adv_estimator": "grpo"}, actor_rollout_ref={"rollout.n": 3})
    expected = ppo_config_from_verl(data)
    real_import = builtins.__import__

    def no_omegaconf(name, *args, **kwargs):
        if name.startswith("omegaconf"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_omegaconf)
    assert ppo_config_from_verl(data) == expected
    with pytest.raises(ValueError, match=r"data\.train_batch_size: cannot resolve"):
        ppo_config_from_verl(_verl(data={"train_batch_size": "${x.y}"}))
    with pytest.raises(ImportError, match="omegaconf"):
        ppo_config_from_verl("some.yaml")


def test_sizes_used_in_arithmetic_must_be_ints():
    with pytest.raises(ValueError) as err:
        ppo_config_from_verl(_verl(actor_rollout_ref={"rollout.n": "4", "actor.ppo_micro_batch_size": 1.5}))
    message = str(err.value)
    assert "actor_rollout_ref.rollout.n must be an int, got str '4'" in message
    assert "actor_rollout_ref.actor.ppo_micro_batch_size must be an int, got float 1.5" in message


def test_rollout_correction_converts_one_to_one():
    fields = {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_sum_k1,token_k3",
        "rollout_rs_threshold": "0.5_2.0,0.01",
    }
    cfg = ppo_config_from_verl(_verl(algorithm={f"rollout_correction.{k}": v for k, v in fields.items()}))
    got = cfg.algorithm.rollout_correction.to_dict()
    assert {k: got[k] for k in fields} == fields and got["bypass_mode"] is False
    assert ppo_config_from_verl({}).algorithm.rollout_correction.enabled is False
    # verl reads loss_type in the bypass mode only
    ignored = ppo_config_from_verl(_verl(algorithm={"rollout_correction.loss_type": "reinforce"}))
    assert ignored.algorithm.rollout_correction.loss_type == "ppo_clip"
    bypass = ppo_config_from_verl(_verl(algorithm={"rollout_correction.bypass_mode": True}))
    assert bypass.algorithm.rollout_correction.bypass_mode is True
    with pytest.raises(
        ValueError, match=r"verl's algorithm\.rollout_correction\.loss_type='reinforce'.*only 'ppo_clip'"
    ):
        ppo_config_from_verl(
            _verl(
                algorithm={
                    "rollout_correction.bypass_mode": True,
                    "rollout_correction.loss_type": "reinforce",
                }
            )
        )
    with pytest.raises(
        ValueError, match=r"rollout_correction\.rollout_rs_threshold='2_0\.5'.*lower <= upper"
    ):
        ppo_config_from_verl(
            _verl(
                algorithm={
                    "rollout_correction.rollout_rs": "token_k1",
                    "rollout_correction.rollout_rs_threshold": "2_0.5",
                }
            )
        )
    with pytest.raises(ValueError, match=r"rollout_correction\.unknown_key"):
        ppo_config_from_verl(_verl(algorithm={"rollout_correction.unknown_key": 1}))


_RC = "algorithm.rollout_correction"


def test_the_composed_config_with_rollout_correction_maps_it_one_to_one():
    overrides = [
        f"{_RC}.rollout_is=token",
        f"{_RC}.rollout_rs=seq_mean_k3",
        f"{_RC}.rollout_rs_threshold=0.01",
    ]
    conversion = convert_verl(composed_config(), overrides)
    assert not conversion.dropped
    assert {f"{_RC}.rollout_is", f"{_RC}.rollout_rs", f"{_RC}.rollout_rs_threshold"} <= set(conversion.mapped)
    correction = PPOConfig.from_dict(conversion.ppo_settings()).algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_rs, correction.rollout_rs_threshold) == (
        "token",
        "seq_mean_k3",
        0.01,
    )
    assert correction.rollout_is_threshold == 2.0 and correction.bypass_mode is False  # verl's defaults


@pytest.mark.parametrize("switch", [f"{_RC}.rollout_is=token", f"{_RC}.rollout_rs=token_k3"])
def test_the_bypass_mode_with_weights_or_rejection_is_refused_naming_the_verl_key(switch):
    overrides = [f"{_RC}.bypass_mode=true", switch, f"{_RC}.rollout_rs_threshold=0.1"]
    with pytest.raises(
        ValueError, match=rf"verl's {_RC}\.bypass_mode=True .*rollout_is=None and rollout_rs=None"
    ):
        convert_verl(composed_config(), overrides)
    bypass = convert_verl(composed_config(), [f"{_RC}.bypass_mode=true"])
    assert bypass.settings["algorithm"]["rollout_correction"]["bypass_mode"] is True


@pytest.mark.parametrize(
    "switch", [None, f"{_RC}.rollout_is=sequence", f"{_RC}.rollout_rs=token_k2", f"{_RC}.bypass_mode=true"]
)
def test_other_rollout_log_probs_are_refused_only_where_the_correction_reads_them(switch):
    on = [] if switch is None else [switch, f"{_RC}.rollout_rs_threshold=0.1"]
    key = "actor_rollout_ref.rollout.logprobs_mode"
    # ppo-core's rollout always returns its log-probs: calculate_log_probs=false is dropped, correction on or off
    base = [*on, "actor_rollout_ref.rollout.calculate_log_probs=false"]
    assert (
        "actor_rollout_ref.rollout.calculate_log_probs=False" in convert_verl(composed_config(), base).dropped
    )
    assert key in convert_verl(composed_config(), [*base, f"{key}=processed_logprobs"]).quiet
    if switch is None:
        dropped = convert_verl(composed_config(), [*base, f"{key}=raw_logprobs"]).dropped
        assert "rollout correction is off" in dropped[f"{key}='raw_logprobs'"]
        return
    with pytest.raises(
        ValueError, match=rf"{key}='raw_logprobs': ppo-core's rollout log-probs are log_softmax"
    ):
        convert_verl(composed_config(), [*base, f"{key}=raw_logprobs"])


# ----- verl 0.9.1's whole config: every key sorted (mapped, quiet, dropped, refused) -------------------------------


def _not_mapped(key: str) -> bool:
    return key not in {rule.key for rule in RULES}


@pytest.mark.parametrize("megatron", [False, True])
def test_the_composed_config_converts_with_every_key_mapped_or_quiet(megatron):
    conversion = convert_verl(composed_config(megatron=megatron))
    keys = set(DEFAULTS) | (set(MEGATRON_DEFAULTS) if megatron else set())
    assert conversion.total == len(keys)
    assert set(conversion.mapped) | set(conversion.quiet) == keys and not conversion.dropped
    assert not set(conversion.mapped) & set(conversion.quiet)
    assert conversion.strategy == ("megatron" if megatron else "fsdp")
    assert "reward_model.enable" in conversion.quiet  # null: verl's default, not a reward model
    # the rollout correction maps one to one; loss_type is read in the bypass mode only (quiet without it)
    assert "algorithm.rollout_correction.rollout_is_threshold" in conversion.mapped
    assert "algorithm.rollout_correction.loss_type" in conversion.quiet
    assert "data.train_files" in conversion.mapped and "actor_rollout_ref.model.path" in conversion.mapped
    # verl's composed defaults give the same trainer settings as an empty verl config
    empty = {"actor_rollout_ref": {"actor": {"strategy": "megatron"}}} if megatron else {}
    assert PPOConfig.from_dict(conversion.ppo_settings()) == ppo_config_from_verl(empty)


def test_the_rule_defaults_are_verls():
    for rule in RULES:
        if rule.key in DEFAULTS and not isinstance(rule.default, Ref) and "${" not in str(DEFAULTS[rule.key]):
            assert rule.default == DEFAULTS[rule.key], rule.key


@settings(
    max_examples=min(5, _CI_EXAMPLES), deadline=None
)  # each example converts a config of up to 900 keys
@given(st.lists(st.sampled_from(sorted(DEFAULTS)), min_size=1, max_size=40, unique=True))
def test_keys_at_verls_defaults_pass_quietly(keys):
    conversion = convert_verl(nested({key: DEFAULTS[key] for key in keys}))
    assert not conversion.dropped
    assert set(conversion.mapped) | set(conversion.quiet) == set(keys)
    assert {key for key in keys if _not_mapped(key)} <= set(conversion.quiet)


def test_every_key_set_away_from_its_default_is_dropped_or_refused_by_name():
    # the keys without a rule: one with no effect on what is computed is dropped with the reason, any other refused
    # (each its own value, so that no key's interpolated default follows another changed key)
    loose = {key: f"changed {key}" for key in DEFAULTS if _not_mapped(key)}
    with pytest.raises(ValueError) as err:
        convert_verl(nested({**DEFAULTS, **loose}))
    refused = {line.split("=", 1)[0].strip() for line in str(err.value).splitlines()[1:]}
    ignored = {key: value for key, value in loose.items() if key not in refused}
    assert refused and ignored
    for key in refused:
        assert f"{key}='changed {key}': " in str(err.value)
    conversion = convert_verl(nested({**DEFAULTS, **ignored}))
    assert set(conversion.dropped) == {f"{key}={value!r}" for key, value in ignored.items()}
    assert all(reason for reason in conversion.dropped.values())


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("algorithm.filter_groups.enable", True, "DAPO's dynamic sampling"),
        ("distillation.enabled", True, "distillation"),
        ("trainer.v1.trainer_mode", "colocate_async", "asynchronous"),
        ("skip.rollout.enable", True, "skipping rollouts"),
        ("reward.reward_model.enable", True, "model-based rewards"),
        ("reward_model.enable", True, "model-based rewards"),
        ("reward.custom_reward_function.path", "my_reward.py", "reward.scorers"),
        ("custom_reward_function.path", "my_reward.py", "reward.scorers"),
        ("reward.reward_manager.name", "dapo", "naive"),
        ("actor_rollout_ref.actor.qat.enable", True, "quantisation-aware training"),
        ("data.truncation", "middle", "middle"),
        ("data.train_max_samples", 100, "shorten the files"),
        ("actor_rollout_ref.model.override_config.attention_dropout", 0.1, "no counterpart"),
        ("actor_rollout_ref.model.override_config", "x", "no counterpart"),
        ("trainer.made_up_key", 1, "not a key of verl's config"),
    ],
)
def test_a_refusal_names_the_key_and_the_reason(key, value, reason):
    with pytest.raises(ValueError) as err:
        convert_verl(_merge_into({"trainer": {"n_gpus_per_node": 1}}, key, value))
    line = next(line for line in str(err.value).splitlines() if line.strip().startswith(f"{key}="))
    assert f"{key}={value!r}: " in line and reason in line.split(": ", 1)[1]


def _merge_into(config: dict, key: str, value) -> dict:
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def test_dropped_keys_are_listed_with_the_reason():
    conversion = convert_verl(
        _verl(
            actor_rollout_ref={
                "rollout.name": "vllm",
                "rollout.gpu_memory_utilization": 0.4,
                "ref.log_prob_micro_batch_size_per_gpu": 4,
                "rollout.n": 2,
            }
        )
    )
    assert set(conversion.dropped) == {
        "actor_rollout_ref.rollout.name='vllm'",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    }
    assert "engine" in conversion.dropped["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"]
    assert conversion.mapped == ("actor_rollout_ref.rollout.n",)


def test_an_overrides_file_keeps_the_prompt_files_lengths_and_model_paths(tmp_path):
    path = tmp_path / "overrides.yaml"
    path.write_text(
        "data:\n  train_files: ~/gsm8k/train.parquet\n  val_files: [a.parquet, b.parquet]\n"
        "  max_prompt_length: 300\n  filter_overlong_prompts: true\n"
        "actor_rollout_ref:\n  model:\n    path: /models/qwen\n    tokenizer_path: /models/tok\n"
        "critic:\n  model:\n    path: /models/critic\n"
    )
    conversion = convert_verl(path)
    data, model = conversion.settings["data"], conversion.settings["model"]
    assert data["train_files"] == [os.path.expanduser("~/gsm8k/train.parquet")]
    assert data["val_files"] == ["a.parquet", "b.parquet"]
    assert data["max_prompt_length"] == 300 and data["truncation"] == "filter"
    assert model == {"path": "/models/qwen", "tokenizer_path": "/models/tok", "critic_path": "/models/critic"}
    assert "model" not in conversion.ppo_settings() and "train_files" not in conversion.ppo_settings()["data"]
    # the critic starting from the actor's checkpoint (or verl's placeholder path) is ppo-core's default
    same = convert_verl(path, ["critic.model.path=/models/qwen"])
    assert "critic_path" not in same.settings["model"]
    assert "critic_path" not in convert_verl({}).settings["model"]


def test_overrides_apply_as_in_hydra(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("algorithm:\n  adv_estimator: gae\ntrainer:\n  val_only: true\n")
    conversion = convert_verl(
        path, ["algorithm.adv_estimator=grpo", "+actor_rollout_ref.rollout.n=4", "~trainer.val_only"]
    )
    assert conversion.settings["algorithm"]["adv_estimator"] == "grpo"
    assert conversion.settings["rollout"]["n"] == 4
    assert "trainer.val_only" not in conversion.quiet + conversion.mapped
    # a multiple of verl's default mini-batch (256 prompts), which must divide it
    assert convert_verl({}, ["data.train_batch_size=512"]).settings["data"]["train_batch_size"] == 512
    with pytest.raises(ValueError, match=r"override 'nonsense'"):
        convert_verl(path, ["nonsense"])


@pytest.mark.parametrize(("mode", "kept"), [("resume_path", True), ("auto", False), ("disable", False)])
def test_a_resume_path_verl_would_not_read_is_dropped(mode, kept, caplog):
    """verl reads ``resume_from_path`` only with ``resume_mode: resume_path``; ppo-core refuses a path its mode would
    not read, so a verl config with a leftover path converts with the path dropped (a warning)."""
    path = "ckpts/global_step_50"
    cfg = ppo_config_from_verl({"trainer": {"resume_mode": mode, "resume_from_path": path}})
    assert cfg.trainer.resume_from_path == (path if kept else None)
    assert ("dropped, verl reads it only with resume_mode: resume_path" in caplog.text) is not kept
