"""Rollout engines by name (``ppo_core.rollout.registry``): engine config classes (registration, their checks with
dotted keys, ``build``), the deprecated factory form, ``auto``, ``generate()`` building one engine per model, and
the actors building their engine once through their config."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import warnings
from dataclasses import dataclass

import pytest
import torch
from _hf import tiny_llama
from tensordict import TensorDict

from ppo_core.models import TinyGPT, TinyGPTConfig
from ppo_core.rollout import (
    ModelRolloutEngine,
    ReferenceEngineConfig,
    RolloutEngineConfig,
    SamplingConfig,
    auto_engine_name,
    generate,
    get_rollout_engine,
    register_rollout_engine,
    registry,
    resolve_engine,
    rollout_engine_config,
    rollout_engine_names,
)
from ppo_core.trainer import PPOConfig
from ppo_core.workers.torch import TorchActorConfig, TorchActorWorker

transformers = pytest.importorskip("transformers")

VOCAB = 29


_llama = functools.partial(tiny_llama, VOCAB)


def _tiny() -> TinyGPT:
    return TinyGPT(TinyGPTConfig(vocab_size=VOCAB, max_seq_len=16, d_model=16, n_heads=2))


class _Counting:
    """A registered engine that counts its builds and delegates to the reference loop."""

    builds = 0

    def __init__(self, model: torch.nn.Module, config: SamplingConfig, label: str = "") -> None:
        type(self).builds += 1
        self.inner = ModelRolloutEngine(model)
        self.label = label

    def generate(self, prompts, prompt_mask, config, *, generator):
        # the reference loop, whatever config.engine names
        plain = dataclasses.replace(config, batch_invariant=False)
        return self.inner.generate(prompts, prompt_mask, plain, generator=generator)


@dataclass(kw_only=True)
class _CountingConfig(RolloutEngineConfig):
    """The counting engine's settings: one label, which must not be empty."""

    label: str = "counted"
    """Carried to the engine."""

    def __post_init__(self) -> None:
        if not self.label:
            raise ValueError("label must not be empty")

    def build(self, model: torch.nn.Module, sampling: SamplingConfig) -> _Counting:
        return _Counting(model, sampling, self.label)


@pytest.fixture
def counting() -> str:
    _Counting.builds = 0
    register_rollout_engine("counting_test", replace=True)(_CountingConfig)
    yield "counting_test"
    registry._CONFIGS.pop("counting_test", None)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([[0, 3, 4], [5, 6, 7]]), torch.tensor([[0, 1, 1], [1, 1, 1]])


def test_builtin_names_and_config_classes() -> None:
    from ppo_core.workers.megatron.rollout_config import MegatronEngineConfig
    from ppo_core_decode.config import HFEngineConfig

    names = rollout_engine_names()
    assert {"reference", "hf", "megatron"} <= set(names) and "auto" not in names
    assert rollout_engine_config("reference") is ReferenceEngineConfig
    assert rollout_engine_config("hf") is HFEngineConfig and HFEngineConfig.name == "hf"
    assert rollout_engine_config("megatron") is MegatronEngineConfig
    # the factory view of a name builds from the config's settings, or the engine's defaults
    assert isinstance(get_rollout_engine("reference")(_tiny(), SamplingConfig()), ModelRolloutEngine)


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="auto"):
        register_rollout_engine("auto")
    with pytest.raises(ValueError, match="non-empty"):
        register_rollout_engine("")

    @dataclasses.dataclass(kw_only=True)
    class OtherConfig(RolloutEngineConfig):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_rollout_engine("reference")(OtherConfig)
    with pytest.raises(ValueError, match="already registered"):  # another factory under a factory's name
        register_rollout_engine("hf")(lambda model, sampling: None)
    with pytest.raises(TypeError, match="RolloutEngineConfig subclass"):
        register_rollout_engine("not_callable_test")(42)  # type: ignore[arg-type]

    class NotADataclass(RolloutEngineConfig):
        pass

    with pytest.raises(TypeError, match="dataclass"):
        register_rollout_engine("not_a_dataclass_test")(NotADataclass)

    @dataclasses.dataclass(kw_only=True)
    class NoBase:  # a settings class that forgot its base: refused at once, not wrapped as a factory
        def build(self, model, sampling):
            return None

    with pytest.raises(TypeError, match=r"NoBase must subclass ppo_core\.rollout\.RolloutEngineConfig"):
        register_rollout_engine("no_base_test")(NoBase)
    assert "no_base_test" not in rollout_engine_names()


def test_the_same_definition_registered_again_keeps_its_name() -> None:
    """A module reloaded (or a notebook cell run twice) defines its config class again: the new class takes the
    name without ``replace``; the built-ins' own classes too."""
    namespace: dict = {}
    source = (
        "import dataclasses\n"
        "from ppo_core.rollout import RolloutEngineConfig, register_rollout_engine\n"
        "@register_rollout_engine('reloaded_test')\n"
        "@dataclasses.dataclass(kw_only=True)\n"
        "class ReloadedConfig(RolloutEngineConfig):\n"
        "    def build(self, model, sampling):\n"
        "        return None\n"
    )
    try:
        for _ in range(2):
            namespace = {"__name__": "reloaded_module"}
            exec(compile(source, "reloaded_module.py", "exec"), namespace)
        assert rollout_engine_config("reloaded_test") is namespace["ReloadedConfig"]
        register_rollout_engine("reference")(ReferenceEngineConfig)  # itself again: nothing changes
        assert rollout_engine_config("reference") is ReferenceEngineConfig
    finally:
        registry._CONFIGS.pop("reloaded_test", None)
    with pytest.raises(ValueError, match=r"valid names: auto, .*hf.*reference"):
        rollout_engine_config("nope")
    with pytest.raises(ValueError, match="auto_engine_name"):
        rollout_engine_config("auto")
    assert "not_callable_test" not in rollout_engine_names()


def test_engine_config_is_checked_once_with_dotted_keys(counting: str) -> None:
    from ppo_core_decode.config import HFEngineConfig

    with pytest.raises(ValueError, match=r"^rollout\.engine_config\.kv_bucket must be >= 1, got 0$"):
        TorchActorConfig.from_dict({"rollout": {"engine": "hf", "engine_config": {"kv_bucket": 0}}})
    with pytest.raises(TypeError, match=r"^rollout\.engine_config\.keep_cache must be a bool"):
        TorchActorConfig.from_dict({"rollout": {"engine": "hf", "engine_config": {"keep_cache": "no"}}})
    with pytest.raises(ValueError, match=r"unknown HFEngineConfig field\(s\) \['kvbucket'\]"):
        SamplingConfig(engine="hf", engine_config={"kvbucket": 64})
    with pytest.raises(ValueError, match=r"^engine_config\.label must not be empty"):  # its own check, named
        SamplingConfig(engine=counting, engine_config={"label": ""})
    with pytest.raises(ValueError, match=r"^engine_config is set .* engine='auto'"):
        SamplingConfig(engine_config={"kv_bucket": 64})
    with pytest.raises(TypeError, match=r"^engine_config must be a _CountingConfig .* got HFEngineConfig"):
        SamplingConfig(engine=counting, engine_config=HFEngineConfig())
    # once built, the settings are the engine's typed config; a mapping and the instance give the same config
    cfg = SamplingConfig(engine="hf", engine_config={"kv_bucket": 64})
    assert cfg.engine_config == HFEngineConfig(kv_bucket=64)
    assert cfg == SamplingConfig(engine="hf", engine_config=HFEngineConfig(kv_bucket=64))
    assert SamplingConfig.from_dict(cfg.to_dict()) == cfg
    assert (
        SamplingConfig(engine="hf").engine_config == HFEngineConfig()
        and SamplingConfig().engine_config is None
    )


def test_engine_settings_reach_the_engine() -> None:
    engine = SamplingConfig(engine="hf", engine_config={"check_every": 3, "kv_bucket": 16}).build_engine(
        _llama()
    )
    assert (engine.decoder.check_every, engine.decoder.kv_bucket) == (3, 16)


def test_a_factory_function_still_registers_with_a_deprecation_warning() -> None:
    builds = []

    def factory(model, config):
        builds.append(config.max_new_tokens)
        return ModelRolloutEngine(model)

    try:
        with pytest.warns(DeprecationWarning, match="RolloutEngineConfig"):
            assert register_rollout_engine("factory_test", replace=True)(factory) is factory
        cls = rollout_engine_config("factory_test")
        assert issubclass(cls, RolloutEngineConfig) and not dataclasses.fields(cls)
        lm = _tiny()
        prompts, mask = _prompts()
        cfg = SamplingConfig(max_new_tokens=2, temperature=0, engine="factory_test")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning, at registration
            out = generate(lm, prompts, mask, cfg)
            generate(lm, prompts, mask, cfg)
        ref = generate(lm, prompts, mask, dataclasses.replace(cfg, engine="reference", engine_config=None))
        assert builds == [2] and torch.equal(out["responses"], ref["responses"])
        # a config naming it travels to worker processes (by the engine's name)
        assert pickle.loads(pickle.dumps(cfg)) == cfg
    finally:
        registry._CONFIGS.pop("factory_test", None)


def test_auto_rule() -> None:
    llama = _llama()
    assert auto_engine_name(_tiny()) == "reference"
    assert auto_engine_name(llama) == "hf"
    assert auto_engine_name(llama, use_cache=False) == "reference"

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama

    assert auto_engine_name(Wrapper()) == "hf"
    own = _tiny()
    own.auto_rollout_engine = "counting"
    assert auto_engine_name(own) == "counting"
    assert resolve_engine("auto", llama) == "hf" and resolve_engine("reference", llama) == "reference"
    with pytest.raises(ValueError, match="not a rollout engine"):
        resolve_engine("nope", llama)


def test_config_names_the_bad_engine_and_lists_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"^engine='vllm' is not a rollout engine; valid names: auto, "
    ) as err:
        SamplingConfig(engine="vllm")
    assert "reference" in str(err.value) and "megatron" in str(err.value)
    with pytest.raises(ValueError, match=r"^rollout\.engine='x' is not a rollout engine"):
        TorchActorConfig.from_dict({"rollout": {"engine": "x"}})
    assert SamplingConfig().engine == "auto"


def test_generate_builds_one_engine_per_model(counting: str) -> None:
    lm = _tiny()
    prompts, mask = _prompts()
    cfg = SamplingConfig(max_new_tokens=3, temperature=0, engine=counting)
    first = generate(lm, prompts, mask, cfg)
    second = generate(lm, prompts, mask, cfg)
    assert _Counting.builds == 1
    assert torch.equal(first["responses"], second["responses"])
    # the registered engine samples what the reference loop samples
    ref = generate(lm, prompts, mask, SamplingConfig(max_new_tokens=3, temperature=0, engine="reference"))
    assert torch.equal(first["responses"], ref["responses"])
    # another model, or other build options, build another engine
    generate(_tiny(), prompts, mask, cfg)
    generate(
        lm,
        prompts,
        mask,
        SamplingConfig(max_new_tokens=3, temperature=0, engine=counting, batch_invariant=True),
    )
    assert _Counting.builds == 3
    # a copy or a pickle of the model does not carry the engine along
    assert _Counting.builds == 3 and not copy.deepcopy(lm).__dict__[registry_slot()]
    assert not pickle.loads(pickle.dumps(lm)).__dict__[registry_slot()]


def registry_slot() -> str:
    import importlib

    return importlib.import_module("ppo_core.rollout.generate")._SLOT


def test_generate_reuses_the_hf_engine_across_weight_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_core_decode import hf

    builds = []
    original = hf.HFRolloutEngine.__init__

    def counted(self, *args, **kwargs):
        builds.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(hf.HFRolloutEngine, "__init__", counted)
    lm = _llama()
    prompts, mask = _prompts()
    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0)
    out = generate(lm, prompts, mask, cfg, generator=torch.Generator().manual_seed(1))
    assert len(builds) == 1
    # the weights change in place (a training step): the kept engine samples what a fresh one does
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    again = generate(lm, prompts, mask, cfg, generator=torch.Generator().manual_seed(1))
    assert len(builds) == 1
    fresh = hf.HFRolloutEngine(lm).generate(prompts, mask, cfg, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again["responses"], fresh["responses"])
    assert torch.equal(again["rollout_log_probs"], fresh["rollout_log_probs"])
    assert not torch.equal(out["rollout_log_probs"], again["rollout_log_probs"])


def _actor(engine: str, model_factory=None) -> TorchActorWorker:
    factory = model_factory or functools.partial(
        TinyGPT, TinyGPTConfig(vocab_size=VOCAB, max_seq_len=16, d_model=16, n_heads=2)
    )
    return TorchActorWorker(
        factory,
        {"rollout": {"max_new_tokens": 3, "engine": engine}, "ppo_mini_batch_size": 2, "device": "cpu"},
    )


def test_torch_actor_builds_its_engine_once_from_its_config(counting: str) -> None:
    factory = functools.partial(
        TinyGPT, TinyGPTConfig(vocab_size=VOCAB, max_seq_len=16, d_model=16, n_heads=2)
    )
    actor = TorchActorWorker(
        factory,
        {
            "rollout": {"max_new_tokens": 3, "engine": counting, "engine_config": {"label": "mine"}},
            "ppo_mini_batch_size": 2,
            "device": "cpu",
        },
    )
    assert isinstance(actor.rollout, _Counting) and _Counting.builds == 1 and actor.rollout.label == "mine"
    prompts, mask = _prompts()
    batch = TensorDict({"input_ids": prompts, "attention_mask": mask}, batch_size=[2])
    for _ in range(3):  # steps: sample, update the weights, sample again
        assert actor.generate_sequences(batch)["responses"].shape == (2, 3)
        with torch.no_grad():
            for p in actor.engine.module.parameters():
                p.add_(0.01)
    assert _Counting.builds == 1


def test_torch_actor_auto_picks_the_engine_for_its_model() -> None:
    from ppo_core_decode.hf import HFRolloutEngine

    assert isinstance(_actor("auto").rollout, ModelRolloutEngine)
    assert isinstance(_actor("auto", _llama).rollout, HFRolloutEngine)
    assert isinstance(_actor("reference", _llama).rollout, ModelRolloutEngine)


def test_generate_rebuilds_the_engine_when_the_model_changes_dtype(counting: str) -> None:
    lm = _tiny()
    prompts, mask = _prompts()
    cfg = SamplingConfig(max_new_tokens=2, temperature=0, engine=counting)
    generate(lm, prompts, mask, cfg)
    generate(lm.to(torch.float64), prompts, mask, cfg)
    assert _Counting.builds == 2
    # the engine of the old placement is dropped: one engine per model and name
    assert len(lm.__dict__[registry_slot()]) == 1


def test_megatron_actor_picks_and_builds_its_engine_through_the_registry(counting: str) -> None:
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from ppo_core.workers.megatron import workers
    from ppo_core.workers.megatron.rollout_config import MegatronEngineConfig

    def setup(attention: str = "sdpa", pp: int = 1, sp: bool = False, engine: str = "auto"):
        eng = SimpleNamespace(
            module=SimpleNamespace(config=SimpleNamespace(sequence_parallel=sp)),
            layout=SimpleNamespace(pp_size=pp, tp_size=1),
        )
        config = SimpleNamespace(
            model=SimpleNamespace(attention=attention),
            rollout=SamplingConfig(engine=engine, max_new_tokens=2),
        )
        return eng, config

    assert workers._auto_engine(*setup()) == "megatron"
    assert workers._auto_engine(*setup(attention="te")) == "reference"
    assert workers._auto_engine(*setup(pp=2)) == "reference"
    assert workers._auto_engine(*setup(sp=True)) == "reference"
    view = _tiny()
    built = workers._default_rollout(*setup(engine=counting), view)
    assert isinstance(built, _Counting) and _Counting.builds == 1
    assert isinstance(workers._default_rollout(*setup(engine="reference"), view), ModelRolloutEngine)
    assert isinstance(workers._default_rollout(*setup(attention="te"), view), ModelRolloutEngine)
    with pytest.raises(TypeError, match="MegatronActorWorker"):
        MegatronEngineConfig().build(view, SamplingConfig())


def test_a_build_that_returns_no_engine_is_named() -> None:
    """A ``build`` that forgot its ``return``: ``generate()`` and the actor's ``build_engine`` say which config
    built what, instead of failing later on ``None.generate``."""

    @dataclasses.dataclass(kw_only=True)
    class ForgetfulConfig(RolloutEngineConfig):
        def build(self, model, sampling):
            ReferenceEngineConfig().build(model, sampling)  # no return

    register_rollout_engine("forgetful_test")(ForgetfulConfig)
    try:
        message = (
            r"rollout engine 'forgetful_test': ForgetfulConfig\.build\(model, sampling\) returned NoneType"
        )
        with pytest.raises(TypeError, match=message):
            generate(
                _tiny(), torch.tensor([[1, 2]]), torch.ones(1, 2), SamplingConfig(engine="forgetful_test")
            )
        with pytest.raises(TypeError, match=message):
            SamplingConfig(engine="forgetful_test").build_engine(_tiny())
    finally:
        registry._CONFIGS.pop("forgetful_test", None)


def test_a_registered_engines_own_check_is_named_by_its_dotted_key() -> None:
    """The registry's documented ``__post_init__`` raises a plain ``ValueError`` starting with the field's name:
    the job's error names ``rollout.engine_config.<field>``, as the library's own checks do; a message that names
    no field stays under the section."""

    @dataclasses.dataclass(kw_only=True)
    class DocumentedConfig(RolloutEngineConfig):
        gpu_memory_utilization: float = 0.5

        def __post_init__(self) -> None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(
                    f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
                )
            if self.gpu_memory_utilization == 0.25:
                raise ValueError("a quarter of the memory is not enough for the engine")

        def build(self, model, sampling):
            return ReferenceEngineConfig().build(model, sampling)

    register_rollout_engine("documented_test")(DocumentedConfig)
    try:
        section = {"engine": "documented_test"}
        with pytest.raises(
            ValueError, match=r"^rollout\.engine_config\.gpu_memory_utilization must be in \(0, 1\]"
        ):
            PPOConfig.from_dict({"rollout": {**section, "engine_config": {"gpu_memory_utilization": 2.0}}})
        with pytest.raises(ValueError, match=r"^rollout\.engine_config: a quarter of the memory"):
            PPOConfig.from_dict({"rollout": {**section, "engine_config": {"gpu_memory_utilization": 0.25}}})
    finally:
        registry._CONFIGS.pop("documented_test", None)


def test_an_engine_class_registered_as_its_own_factory_still_works() -> None:
    """The deprecated factory API took any ``factory(model, config) -> engine``: an engine class whose constructor
    has that signature is one (a warning), unlike a settings class that forgot its base."""

    class OwnFactory:
        def __init__(self, model, config) -> None:
            self.inner = ModelRolloutEngine(model)

        def generate(self, prompts, prompt_mask, config, *, generator):
            return self.inner.generate(prompts, prompt_mask, config, generator=generator)

    try:
        with pytest.warns(DeprecationWarning, match="factory function is deprecated"):
            register_rollout_engine("own_factory_test")(OwnFactory)
        out = generate(
            _tiny(),
            torch.tensor([[1, 2]]),
            torch.ones(1, 2),
            SamplingConfig(engine="own_factory_test", max_new_tokens=2, temperature=0),
        )
        assert out["responses"].shape == (1, 2)
    finally:
        registry._CONFIGS.pop("own_factory_test", None)
