"""Every config field is type-checked at construction, and errors name the field's dotted path.

The check is generic (``ConfigBase`` reads each field's annotation), so the tests below are generic too: every
config class in the repository is enumerated, every scalar field is given values of the wrong type, and the error
must be a ``TypeError`` whose message starts with the field's name.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
import typing

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ppo_core._config_base as config_base
from ppo_core._config_base import ConfigBase
from ppo_core.config import AlgorithmConfig
from ppo_core.data.prompts import PromptDatasetConfig
from ppo_core.examples.arith_task import ArithTaskConfig
from ppo_core.examples.arithmetic import ArithmeticConfig
from ppo_core.examples.make_data import TinyModelConfig
from ppo_core.kernels.triton_scan import ScanLaunch
from ppo_core.kl_control import KLConfig
from ppo_core.losses import PolicyLossConfig
from ppo_core.models import TinyGPTConfig
from ppo_core.rollout import ReferenceEngineConfig, RolloutEngineConfig, SamplingConfig
from ppo_core.rollout_correction import RolloutCorrectionConfig
from ppo_core.trainer.config import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    PPOConfig,
    RolloutConfig,
    TrainerConfig,
)
from ppo_core.workers.config import OptimConfig, PPOActorConfig, PPOCriticConfig, PPOWorkerConfig
from ppo_core.workers.megatron.config import (
    MegatronActorConfig,
    MegatronCriticConfig,
    MegatronModelConfig,
    ParallelConfig,
)
from ppo_core.workers.megatron.rollout_config import MegatronEngineConfig
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig
from ppo_core_cli.config import (
    JobActorConfig,
    JobConfig,
    JobCriticConfig,
    JobDataConfig,
    JobModelConfig,
    JobRolloutConfig,
    RewardConfig,
    ScorerConfig,
    SFTConfig,
)
from ppo_core_decode.config import CachedEngineConfig, HFEngineConfig
from ppo_core_monarch.config import MonarchConfig

_MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "vocab_size": 64,
}

# Every config class of the repository, with the fields it requires (no default).
REQUIRED: dict[type, dict[str, typing.Any]] = {
    AlgorithmConfig: {},
    KLConfig: {},
    RolloutCorrectionConfig: {},
    PolicyLossConfig: {},
    DataConfig: {},
    ActorConfig: {},
    CriticConfig: {},
    RolloutConfig: {},
    TrainerConfig: {},
    PPOConfig: {},
    TinyGPTConfig: {"vocab_size": 16},
    MonarchConfig: {},
    OptimConfig: {},
    PPOWorkerConfig: {},
    PPOActorConfig: {},
    PPOCriticConfig: {},
    TorchActorConfig: {},
    TorchCriticConfig: {},
    SamplingConfig: {},
    RolloutEngineConfig: {},
    ReferenceEngineConfig: {},
    CachedEngineConfig: {},
    HFEngineConfig: {},
    MegatronEngineConfig: {},
    MegatronModelConfig: _MODEL,
    ParallelConfig: {},
    MegatronActorConfig: {},
    MegatronCriticConfig: {},
    ScanLaunch: {"block_b": 1, "block_t": 128},
    PromptDatasetConfig: {},
    ArithTaskConfig: {},
    ArithmeticConfig: {},
    TinyModelConfig: {},
    JobConfig: {},
    JobActorConfig: {},
    JobCriticConfig: {},
    JobRolloutConfig: {},
    JobDataConfig: {},
    JobModelConfig: {},
    RewardConfig: {},
    ScorerConfig: {},
    SFTConfig: {},
}

# Values of the wrong type for each scalar annotation (a YAML string, a bool for a number, a float for an int).
WRONG: dict[object, list[object]] = {
    bool: ["false", "no", 0, 1, None],
    int: ["0", 1.5, 2.0, True, None],
    float: ["0.5", True, None, [0.5]],
    str: [5, None, b"x", ["a"]],
    int | None: ["3", 2.5, False],
    float | None: ["0.2", True],
    str | None: [5, True, ["x"]],
    bool | None: ["true", 1],
}


def _all_config_classes() -> set[type]:
    import importlib
    import pkgutil

    import ppo_core

    # import every module, so that the answer does not depend on which tests ran before
    for info in pkgutil.walk_packages(ppo_core.__path__, "ppo_core."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (triton...) that this machine lacks
            continue
    found, todo = set(), [ConfigBase]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {c for c in found if dataclasses.is_dataclass(c) and not c.__name__.startswith("_")}


def test_every_config_class_is_covered():
    """A new config class must be added to REQUIRED (so that the generic tests below check it)."""
    classes = {c for c in _all_config_classes() if c.__module__.startswith(("ppo_core", "ppo_core_monarch"))}
    assert classes == set(REQUIRED)


def _scalar_fields(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if hints[f.name] in WRONG]


@pytest.mark.parametrize("cls", sorted(REQUIRED, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_wrong_scalar_types_raise_type_error_naming_the_field(cls):
    fields = _scalar_fields(cls)
    for name, tp in fields:
        for bad in WRONG[tp]:
            kwargs = {**REQUIRED[cls], name: bad}
            with pytest.raises(TypeError) as err:
                cls(**kwargs)
            message = str(err.value)
            assert message.startswith(f"{name} must be a"), (cls.__name__, name, bad, message)
            assert type(bad).__name__ in message
            # the same mistake through from_dict, one level down, carries the dotted path
            with pytest.raises(TypeError, match=rf"^section\.{name} must be a"):
                _nested(cls, kwargs)


def _nested(cls: type, kwargs: dict) -> None:
    outer = dataclasses.make_dataclass("Outer", [("section", cls)], bases=(ConfigBase,), kw_only=True)
    outer.from_dict({"section": kwargs})


@pytest.mark.parametrize("cls", sorted(REQUIRED, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_defaults_pass_and_round_trip(cls):
    cfg = cls(**REQUIRED[cls])
    assert cls.from_dict(cfg.to_dict()) == cfg
    assert cls.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # lists for tuples, as from YAML/JSON


# ----- the cases of the bug report ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (
            {"trainer": {"val_before_train": "false"}},
            TypeError,
            "trainer.val_before_train must be a bool, got str 'false'",
        ),
        ({"trainer": {"progress_bar": "no"}}, TypeError, "trainer.progress_bar must be a bool, got str 'no'"),
        ({"trainer": {"seed": "0"}}, TypeError, "trainer.seed must be an int, got str '0'"),
        ({"trainer": {"seed": -1}}, ValueError, "trainer.seed must be >= 0, got -1"),
        ({"data": {"seed": 1.5}}, TypeError, "data.seed must be an int, got float 1.5"),
        (
            {"trainer": {"default_local_dir": None}},
            TypeError,
            "trainer.default_local_dir must be a str, got NoneType None",
        ),
        ({"trainer": {"log_dir": 5}}, TypeError, "trainer.log_dir must be a str or None, got int 5"),
        (
            {"actor": {"worker": [1, 2]}},
            TypeError,
            "actor.worker must be a dict or a config, got list [1, 2]",
        ),
        (
            {"actor": {"worker": {1: 2}}},
            TypeError,
            "actor.worker must be a dict or a config, got dict {1: 2}",
        ),
        ({"rollout": {"n": 0}}, ValueError, "rollout.n must be >= 1, got 0"),
        ({"data": {"val_batch_size": 0}}, ValueError, "data.val_batch_size must be >= 1, got 0"),
        ({"critic": {"enable": "yes"}}, TypeError, "critic.enable must be a bool or None, got str 'yes'"),
        ({"algorithm": {"gamma": True}}, TypeError, "algorithm.gamma must be a float, got bool True"),
        ({"algorithm": {"gamma": 1.5}}, ValueError, "algorithm.gamma must be in [0, 1], got 1.5"),
        (
            {"algorithm": {"kl_ctrl": {"kl_coef": "0.1"}}},
            TypeError,
            "algorithm.kl_ctrl.kl_coef must be a float, got str '0.1'",
        ),
        (
            {"algorithm": {"kl_ctrl": {"horizon": 0}}},
            ValueError,
            "algorithm.kl_ctrl.horizon must be a finite number > 0, got 0",
        ),
        (
            {"algorithm": {"kl_ctrl": {"type": "pid"}}},
            ValueError,
            "unknown algorithm.kl_ctrl.type 'pid'; valid values: adaptive, fixed",
        ),
        (
            {"algorithm": {"kl_ctrl": 0.1}},
            TypeError,
            "algorithm.kl_ctrl must be a KLConfig or a dict, got float 0.1",
        ),
        (
            {"trainer": {"loggers": ["console", "mlflow"]}},
            ValueError,
            "unknown trainer.loggers[1] 'mlflow'; valid values: console, jsonl, tensorboard, wandb",
        ),
        (
            {"trainer": {"loggers": "console"}},
            TypeError,
            "trainer.loggers must be a list or tuple, got str 'console'",
        ),
        (
            {"trainer": {"resume_mode": 1}},
            TypeError,
            "trainer.resume_mode must be one of 'auto', 'disable', 'path', got int 1",
        ),
        ({"trainer": "x"}, TypeError, "trainer must be a TrainerConfig or a dict, got str 'x'"),
        ({"trainer": {"bogus": 1}}, ValueError, "trainer: unknown TrainerConfig field(s) ['bogus']"),
    ],
)
def test_ppo_config_errors_name_the_dotted_path(data, error, message):
    with pytest.raises(error) as err:
        PPOConfig.from_dict(data)
    assert str(err.value).startswith(message), str(err.value)


def test_actor_loss_agg_mode_is_checked_at_construction():
    # (a field the workers redesign removes; then the key is unknown, which names it too)
    with pytest.raises(ValueError, match=r"actor.*loss_agg_mode"):
        PPOConfig.from_dict({"actor": {"loss_agg_mode": "bogus"}})


def test_from_dict_rejects_a_non_mapping_naming_the_class():
    with pytest.raises(TypeError, match=r"^PPOConfig\.from_dict expects a mapping, got str 'data'$"):
        PPOConfig.from_dict("data")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^KLConfig\.from_dict expects a mapping, got list \[1\]$"):
        KLConfig.from_dict([1])  # type: ignore[arg-type]


def test_missing_required_field_is_named():
    with pytest.raises(TypeError, match=r"^model\.vocab_size is required"):
        MegatronActorConfig.from_dict({"model": {k: v for k, v in _MODEL.items() if k != "vocab_size"}})


def test_monarch_config_numbers():
    with pytest.raises(TypeError, match=r"^call_timeout_s must be a float, got str '60'$"):
        MonarchConfig(call_timeout_s="60")  # type: ignore[arg-type]
    cfg = MonarchConfig(call_timeout_s=60)
    assert cfg.call_timeout_s == 60.0 and type(cfg.call_timeout_s) is float  # frozen, still normalised
    with pytest.raises(TypeError, match=r"^worker_env\['A'\] must be a str, got int 1$"):
        MonarchConfig(worker_env={"A": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^unknown device 'tpu'; valid values: auto, cpu, cuda$"):
        MonarchConfig.from_dict({"device": "tpu"})
    with pytest.raises(ValueError, match=r"^torch_threads must be >= 0, got -1$"):
        MonarchConfig(torch_threads=-1)


def test_choices_are_checked_at_construction():
    with pytest.raises(ValueError, match=r"^unknown loss_agg_mode 'bogus'; valid values: "):
        PolicyLossConfig(loss_agg_mode="bogus")
    with pytest.raises(ValueError, match=r"^unknown loss_agg_mode 'bogus'"):
        TorchCriticConfig(loss_agg_mode="bogus")
    with pytest.raises(ValueError, match=r"^policy_loss: unknown policy loss \(loss_mode\) 'ppo'"):
        TorchActorConfig.from_dict({"policy_loss": {"loss_mode": "ppo"}})
    with pytest.raises(ValueError, match=r"^unknown kl_loss_type 'k4'"):
        TorchActorConfig(kl_loss_type="k4")
    with pytest.raises(ValueError, match=r"^model\.norm: |^unknown model\.norm 'BatchNorm'"):
        MegatronActorConfig.from_dict({"model": {**_MODEL, "norm": "BatchNorm"}})


def test_worker_config_nesting():
    cfg = TorchActorConfig.from_dict({"optim": {"betas": [0.9, 0.99], "lr": 1}})
    assert cfg.optim.betas == (0.9, 0.99) and type(cfg.optim.lr) is float
    with pytest.raises(
        TypeError, match=r"^optim\.betas must be a list or tuple of 2 items, got list \[0\.9\]$"
    ):
        TorchActorConfig.from_dict({"optim": {"betas": [0.9]}})
    with pytest.raises(TypeError, match=r"^optim\.betas\[1\] must be a float, got str '0.99'$"):
        TorchActorConfig.from_dict({"optim": {"betas": [0.9, "0.99"]}})
    with pytest.raises(TypeError, match=r"^policy_loss\.clip_ratio must be a float, got str '0.2'$"):
        TorchActorConfig.from_dict({"policy_loss": {"clip_ratio": "0.2"}})
    with pytest.raises(ValueError, match=r"^optim\.lr must be a finite number > 0, got -1\.0$"):
        TorchActorConfig.from_dict({"optim": {"lr": -1.0}})
    with pytest.raises(ValueError, match=r"^parallel\.tensor_model_parallel_size must be >= 1, got 0$"):
        MegatronActorConfig.from_dict({"parallel": {"tensor_model_parallel_size": 0}})
    with pytest.raises(TypeError, match=r"^model\.num_layers must be an int, got str '2'$"):
        MegatronCriticConfig.from_dict({"model": {**_MODEL, "num_layers": "2"}})
    with pytest.raises(TypeError, match=r"^rollout\.max_new_tokens must be an int, got float 2\.0$"):
        TorchActorConfig.from_dict({"rollout": {"max_new_tokens": 2.0}})


def test_normalisation_of_accepted_values():
    assert type(AlgorithmConfig(gamma=1).gamma) is float
    assert TrainerConfig(seed=np.int64(3)).seed == 3 and type(TrainerConfig(seed=np.int64(3)).seed) is int
    assert TrainerConfig(default_local_dir=pathlib.Path("runs/x")).default_local_dir == "runs/x"
    assert TrainerConfig(loggers=["jsonl"]).loggers == ("jsonl",)


def test_omegaconf_containers_are_accepted_and_become_plain():
    omegaconf = pytest.importorskip("omegaconf")
    yaml = omegaconf.OmegaConf.create(
        {
            "trainer": {"loggers": ["console"], "seed": 3},
            "actor": {"worker": {"optim": {"lr": 1e-5, "betas": [0.9, 0.95]}}},
        }
    )
    cfg = PPOConfig.from_dict(yaml)
    assert cfg.trainer.loggers == ("console",) and cfg.trainer.seed == 3
    assert cfg.actor.worker == {"optim": {"lr": 1e-5, "betas": [0.9, 0.95]}}
    assert type(cfg.actor.worker["optim"]) is dict and type(cfg.actor.worker["optim"]["betas"]) is list
    json.dumps(cfg.to_dict())


def test_errors_survive_pickling():
    """Remote workers send their errors back pickled; the message and the type must survive."""
    with pytest.raises(TypeError) as err:
        PPOConfig.from_dict({"trainer": {"seed": "0"}})
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is type(err.value) and str(again) == str(err.value)


def test_type_hints_are_resolved_once_per_class(monkeypatch):
    calls = []
    real = typing.get_type_hints

    def counting(obj, *args, **kwargs):
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(config_base.typing, "get_type_hints", counting)

    @dataclasses.dataclass(kw_only=True)
    class Fresh(ConfigBase):
        a: int = 1

    for i in range(5):
        Fresh(a=i)
        Fresh.from_dict({"a": i})
    assert calls.count(Fresh) == 1


def test_unsupported_annotation_is_reported_to_the_author():
    @dataclasses.dataclass(kw_only=True)
    class Odd(ConfigBase):
        f: typing.Callable[[int], int] | None = None

    with pytest.raises(TypeError, match=r"Odd\.f"):
        Odd()


@given(
    st.builds(
        TrainerConfig,
        total_epochs=st.integers(1, 10),
        seed=st.integers(0, 2**32 - 1),
        loggers=st.lists(st.sampled_from(["console", "jsonl", "tensorboard"]), max_size=3).map(tuple),
        log_dir=st.none() | st.text(max_size=5),
        progress_bar=st.booleans(),
        resume_mode=st.sampled_from(["auto", "disable"]),
    )
)
def test_trainer_config_round_trips(cfg):
    assert TrainerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@dataclasses.dataclass(kw_only=True)
class _Leaf(ConfigBase):
    x: int = 0


@dataclasses.dataclass(kw_only=True)
class _Holder(ConfigBase):
    by_name: dict[str, _Leaf] = dataclasses.field(default_factory=dict)
    items: list[_Leaf] = dataclasses.field(default_factory=list)
    pair: tuple[_Leaf, _Leaf] = (_Leaf(), _Leaf())


def test_to_dict_turns_configs_inside_dicts_and_lists_into_dicts():
    """A ``dict[str, Config]`` / ``list[Config]`` field round-trips through plain data (YAML writes no objects)."""
    holder = _Holder(by_name={"a": {"x": 1}}, items=[{"x": 2}, _Leaf(x=3)], pair=(_Leaf(x=4), {"x": 5}))
    plain = holder.to_dict()
    assert plain == {"by_name": {"a": {"x": 1}}, "items": [{"x": 2}, {"x": 3}], "pair": ({"x": 4}, {"x": 5})}
    assert _Holder.from_dict(plain) == holder


def test_coerce_takes_an_instance_or_a_mapping_and_names_what_else_it_got():
    cfg = RolloutCorrectionConfig(rollout_is="token")
    assert RolloutCorrectionConfig.coerce(cfg) is cfg
    assert RolloutCorrectionConfig.coerce({"rollout_is": "token"}) == cfg
    assert TorchActorConfig.coerce(None, none_is_default=True) == TorchActorConfig()
    with pytest.raises(
        TypeError, match=r"^config must be a RolloutCorrectionConfig or a dict, got NoneType None$"
    ):
        RolloutCorrectionConfig.coerce(None)
    with pytest.raises(TypeError, match=r"^actor must be a TorchActorConfig or a dict, got PPOCriticConfig "):
        TorchActorConfig.coerce(PPOCriticConfig(), what="actor")
    with pytest.raises(ValueError, match="unknown RolloutCorrectionConfig field"):
        RolloutCorrectionConfig.coerce({"rollout_iss": "token"})


def test_the_trainer_workers_and_correction_refuse_a_config_of_another_type():
    from ppo_core import compute_rollout_correction
    from ppo_core.trainer.base import BasePPOTrainer
    from ppo_core.workers.torch import TorchActorWorker

    t = torch.zeros(1, 2)
    with pytest.raises(
        TypeError, match=r"^config must be a RolloutCorrectionConfig or a dict, got str 'token'"
    ):
        compute_rollout_correction(t, t, torch.ones(1, 2), "token")
    with pytest.raises(TypeError, match=r"^config must be a PPOConfig or a dict, got list"):
        trainer = type("Trainer", (BasePPOTrainer,), {"init_workers": lambda self: None})
        trainer([], train_dataset=[], reward_fn=lambda *a: 0.0)
    with pytest.raises(TypeError, match=r"^config must be a TorchActorConfig or a dict, got int 3"):
        TorchActorWorker(lambda: None, 3)
