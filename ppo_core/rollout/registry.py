"""Rollout engines by name: which engine samples for a model, and how to plug in your own.

Each engine is a typed config class (:class:`~ppo_core.rollout.engine_config.RolloutEngineConfig`): a dataclass of
the engine's build-time settings that checks itself once, when it is built, and whose ``build(model, sampling)``
returns the engine. The registry maps a name to that class. A config names the engine with ``rollout.engine``
(``SamplingConfig.engine``) and sets its settings under ``rollout.engine_config`` (``SamplingConfig.engine_config``,
an instance of the named engine's class once the config is built); an actor worker calls
:meth:`~ppo_core.rollout.sampling.SamplingConfig.build_engine` once and calls the engine for every batch
(:func:`~ppo_core.rollout.generate.generate` keeps the engine it built for a model), so an engine must read the
model's current weights on every call (or receive them through ``update_weights``,
:class:`~ppo_core.rollout.engine.WeightReceiver`).

Built-in names (their config modules import no engine; ``build`` imports it):

- ``reference``: :class:`~ppo_core.rollout.engine_config.ReferenceEngineConfig` ->
  :class:`~ppo_core.rollout.engine.ModelRolloutEngine`, the simple loop of :func:`generate` (recomputes every
  step, or decodes through the model's own ``new_cache()``); no settings;
- ``hf``: :class:`~ppo_core_decode.config.HFEngineConfig` -> :class:`~ppo_core_decode.hf.HFRolloutEngine`, the
  static-KV-cache, graph-captured engine for Hugging Face causal LMs: the fused path for the ``llama``,
  ``mistral``, ``qwen2`` and ``qwen3`` model types, and for any other causal LM whose attention goes through
  ``transformers``' attention interface (GPT-NeoX, Phi, Gemma...) the generic path, the model's own ``forward``
  with its attention through the cache (its speed per family: ``docs/performance.md``, "Rollout by model family");
- ``megatron``: :class:`~ppo_core.workers.megatron.rollout_config.MegatronEngineConfig` ->
  :class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine`, the same for the megatron actor's
  ``GPTModel`` (the model is the megatron actor worker's policy view);
- ``auto``: :func:`auto_engine_name` picks one of them for the model, with its default settings (the megatron
  actor worker applies its own rule for its policy: ``megatron`` where the model allows it, SDPA attention and no
  pipeline or sequence parallelism, else ``reference``). ``engine_config`` needs a named engine.

Registering your own (an adapter to vLLM, SGLang...): a config class with your engine's settings and ``build``::

    from dataclasses import dataclass
    from ppo_core.rollout import RolloutEngineConfig, register_rollout_engine

    @register_rollout_engine("vllm")
    @dataclass(kw_only=True)
    class VLLMEngineConfig(RolloutEngineConfig):
        gpu_memory_utilization: float = 0.5
        \"\"\"Fraction of the GPU's memory the engine may take.\"\"\"

        def __post_init__(self) -> None:  # checked once, when the config is built
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

        def build(self, model, sampling):  # once per actor worker
            return MyVLLMEngine(model, self, sampling)  # a RolloutEngine (and a WeightReceiver if it copies weights)

then set ``rollout.engine: vllm`` and ``rollout.engine_config: {gpu_memory_utilization: 0.8}`` in a job (the
module that registers it must be imported first, e.g. by your entry point), or pass
``SamplingConfig(engine="vllm", engine_config={...})`` to :func:`generate`. A bad setting fails when the config
is built, naming its dotted key (``rollout.engine_config.gpu_memory_utilization must be in (0, 1]``).

Deprecated (one release): registering a function ``factory(model, config) -> RolloutEngine`` with
``register_rollout_engine(name)(factory)`` still works; it logs a deprecation warning and is wrapped in a config
class without settings whose ``build`` calls the factory.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ppo_core.rollout.engine_config import ReferenceEngineConfig, RolloutEngineConfig

__all__ = [
    "AUTO",
    "EngineFactory",
    "auto_engine_name",
    "get_rollout_engine",
    "register_rollout_engine",
    "resolve_engine",
    "rollout_engine_config",
    "rollout_engine_names",
]

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The engine name that lets :func:`auto_engine_name` choose."""

EngineFactory = Callable[[nn.Module, Any], Any]
"""``factory(model, config: SamplingConfig) -> RolloutEngine`` (the deprecated registration form)."""

C = TypeVar("C")

_CONFIGS: dict[str, type[RolloutEngineConfig] | str] = {
    # built-ins by "module:attribute" where the module is not this layer's; the config modules import no engine
    "reference": ReferenceEngineConfig,
    "hf": "ppo_core_decode.config:HFEngineConfig",
    "megatron": "ppo_core.workers.megatron.rollout_config:MegatronEngineConfig",
}


def _factory_config(name: str, factory: EngineFactory) -> type[RolloutEngineConfig]:
    """A config class without settings whose ``build`` calls the deprecated ``factory(model, sampling)``."""

    def build(self: RolloutEngineConfig, model: nn.Module, sampling: Any) -> Any:
        return factory(model, sampling)

    def reduce(self: RolloutEngineConfig) -> tuple[Any, tuple[str]]:
        # a class made here has no importable name: a copy (a worker process's) looks it up by its engine name
        return _registered_default, (name,)

    cls = dataclasses.make_dataclass(
        f"FactoryEngineConfig_{name}",
        [],
        bases=(RolloutEngineConfig,),
        namespace={"build": build, "factory": staticmethod(factory), "__reduce__": reduce},
        kw_only=True,
    )
    cls.__doc__ = (
        f"``{name}``: the engine of the registered factory {getattr(factory, '__qualname__', factory)!r}."
    )
    return cls


def _registered_default(name: str) -> RolloutEngineConfig:
    """The default config of the engine registered under ``name`` (how a factory-wrapped config unpickles)."""
    return rollout_engine_config(name)()


def register_rollout_engine(name: str, *, replace: bool = False) -> Callable[[C], C]:
    """Register a rollout engine's config class under ``name`` (a class decorator; returns the class).

    The class is a ``@dataclass(kw_only=True)`` subclass of
    :class:`~ppo_core.rollout.engine_config.RolloutEngineConfig` (its settings, checked in ``__post_init__``) with
    ``build(model, sampling) -> RolloutEngine``. Deprecated: a function ``factory(model, config) ->
    RolloutEngine`` is accepted too (a warning; wrapped in a config class without settings).

    Raises ``ValueError`` for the reserved name ``auto``, an empty name, or a name already registered to another
    class (unless ``replace=True``; the same class defined again, as a reloaded module does, takes it back);
    ``TypeError`` for a class that neither subclasses ``RolloutEngineConfig`` nor has a ``generate`` (a settings
    class that forgot its base), and for anything else not callable.

    Example:
        >>> from dataclasses import dataclass
        >>> @register_rollout_engine("doc_example", replace=True)
        ... @dataclass(kw_only=True)
        ... class DocEngineConfig(RolloutEngineConfig):
        ...     def build(self, model, sampling):
        ...         return ReferenceEngineConfig().build(model, sampling)
        >>> rollout_engine_config("doc_example") is DocEngineConfig, DocEngineConfig.name
        (True, 'doc_example')
    """
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(
            f"a rollout engine's name must be a non-empty string other than {AUTO!r}, got {name!r}"
        )

    def register(item: C) -> C:
        if isinstance(item, type) and issubclass(item, RolloutEngineConfig):
            if "__dataclass_fields__" not in vars(item):  # its own @dataclass, not only its base's
                raise TypeError(
                    f"rollout engine {name!r}: {item.__name__} must be a @dataclass(kw_only=True)"
                )
            cls: type[RolloutEngineConfig] = item
        elif isinstance(item, type) and not callable(getattr(item, "generate", None)):
            # a settings class that forgot its base (an engine class with generate() is a deprecated factory)
            raise TypeError(
                f"rollout engine {name!r}: {item.__name__} must subclass ppo_core.rollout.RolloutEngineConfig "
                "(a @dataclass(kw_only=True) of the engine's settings with build(model, sampling))"
            )
        elif callable(item):
            warnings.warn(
                f"register_rollout_engine({name!r}) of a factory function is deprecated: register a "
                "RolloutEngineConfig subclass with build(model, sampling) (ppo_core.rollout.registry)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls = _factory_config(name, item)
        else:
            raise TypeError(
                f"rollout engine {name!r}: register a RolloutEngineConfig subclass (or, deprecated, a factory "
                f"function), got {type(item).__name__}"
            )
        if name in _CONFIGS and not replace and not _same_definition(_CONFIGS[name], cls):
            raise ValueError(
                f"rollout engine {name!r} is already registered (pass replace=True to replace it)"
            )
        cls.name = name
        _CONFIGS[name] = cls
        return item

    return register


def _same_definition(old: type | str, new: type) -> bool:
    """Whether ``new`` is ``old`` defined again (the same module and qualified name, of the class or of a
    deprecated factory: a module reloaded, a notebook cell run twice), which may take its name without
    ``replace``. ``old`` may be a built-in entry's ``"module:Class"`` path."""

    def definition(entry: type | str) -> str:
        if isinstance(entry, str):
            return entry
        made_of = getattr(entry, "factory", entry)  # a factory's wrapper class: the factory
        return f"{made_of.__module__}:{made_of.__qualname__}"

    again = definition(new)
    # a lambda or a class made in a function: a name that does not identify a definition
    return "<" not in again and definition(old) == again


def rollout_engine_names() -> tuple[str, ...]:
    """The registered names, sorted (``auto`` is not among them: it names one of these)."""
    return tuple(sorted(_CONFIGS))


def check_engine_name(name: str, path: str = "engine") -> str:
    """``name`` if it is ``auto`` or registered, else ``ValueError`` naming ``path`` and listing the valid names."""
    if name != AUTO and name not in _CONFIGS:
        valid = ", ".join((AUTO, *rollout_engine_names()))
        raise ValueError(f"{path}={name!r} is not a rollout engine; valid names: {valid}")
    return name


def rollout_engine_config(name: str) -> type[RolloutEngineConfig]:
    """The config class registered under ``name`` (``ValueError`` listing the valid names otherwise)."""
    if name == AUTO or name not in _CONFIGS:
        check_engine_name(name)
        raise ValueError(f"{AUTO!r} names no engine: resolve it with auto_engine_name(model) first")
    cls = _CONFIGS[name]
    if isinstance(cls, str):
        module, _, attribute = cls.partition(":")
        cls = getattr(importlib.import_module(module), attribute)
        cls.name = name
        _CONFIGS[name] = cls
    return cls


def get_rollout_engine(name: str) -> EngineFactory:
    """``factory(model, sampling) -> RolloutEngine`` for ``name``: the engine built from ``sampling.engine_config``
    when it is this engine's config, else from the engine's default config. Kept for code written against the
    factory registry; new code calls ``sampling.build_engine(model)``."""
    cls = rollout_engine_config(name)

    def factory(model: nn.Module, sampling: Any) -> Any:
        settings = getattr(sampling, "engine_config", None)
        return (settings if isinstance(settings, cls) else cls()).build(model, sampling)

    return factory


def auto_engine_name(model: nn.Module, *, use_cache: bool = True) -> str:
    """The engine ``auto`` picks for ``model``:

    1. the model's own choice, when it has an ``auto_rollout_engine`` attribute (a string: a model class that
       knows its engine says so);
    2. ``hf`` for a Hugging Face causal LM (a ``transformers.PreTrainedModel`` with an ``lm_head``, or a wrapper
       holding one as ``.model``) when ``use_cache``, unless its attention computes what the ``hf`` engine's cached
       attention does not (soft-capped scores, attention sinks:
       :func:`ppo_core_decode.hf.unsupported_attention`; logged);
    3. ``reference`` otherwise.

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> auto_engine_name(TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2)))
        'reference'
    """
    own = getattr(model, "auto_rollout_engine", None)
    if isinstance(own, str):
        return own
    if use_cache and (hf := hf_causal_lm(model)) is not None:
        from ppo_core_decode.hf import unsupported_attention

        reason = unsupported_attention(hf)
        if reason is None:
            return "hf"
        logger.info("rollout engine auto: reference for %s (%s)", type(hf).__name__, reason)
    return "reference"


def resolve_engine(name: str, model: nn.Module, *, use_cache: bool = True) -> str:
    """``name``, or for ``auto`` the name :func:`auto_engine_name` picks for ``model`` (``ValueError`` for an
    unregistered name)."""
    check_engine_name(name)
    return auto_engine_name(model, use_cache=use_cache) if name == AUTO else name


def hf_causal_lm(model: nn.Module) -> nn.Module | None:
    """The ``transformers`` causal LM behind ``model`` (itself, or a wrapper's ``.model``), else None.

    Checked without importing ``transformers`` when nothing has imported it.
    """
    tf = sys.modules.get("transformers")
    if tf is None:
        return None
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, tf.PreTrainedModel) and hasattr(candidate, "lm_head"):
            return candidate
    return None
