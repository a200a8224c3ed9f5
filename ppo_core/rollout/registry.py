"""Rollout engines by name: which engine samples for a model, and how to plug in your own.

An engine factory is ``factory(model, config) -> RolloutEngine``: ``model`` is the policy as the actor worker (or
:func:`~ppo_core.rollout.generate.generate`) holds it, ``config`` the :class:`~ppo_core.rollout.sampling.SamplingConfig`
the engine is built for (the options it fixes at build time, such as ``batch_invariant``). The engine is built once
and then called for every batch (a worker builds its engine once; :func:`generate` keeps the engine it built for a
model), so an engine must read the model's current weights on every call (or receive them through
``update_weights``, :class:`~ppo_core.rollout.engine.WeightReceiver`).

Built-in names (their modules are imported only when the engine is built):

- ``reference``: :class:`~ppo_core.rollout.engine.ModelRolloutEngine`, the simple loop of :func:`generate`
  (recomputes every step, or decodes through the model's own ``new_cache()``);
- ``hf``: :class:`~ppo_core_decode.hf.HFRolloutEngine`, the static-KV-cache, graph-captured engine for Hugging Face
  causal LMs: the fused path for the ``llama``, ``mistral``, ``qwen2`` and ``qwen3`` model types, and for any other
  causal LM whose attention goes through ``transformers``' attention interface (GPT-NeoX, Phi, Gemma...) the
  generic path, the model's own ``forward`` with its attention through the cache (its speed per family:
  ``docs/performance.md``, "Rollout by model family");
- ``megatron``: :class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine`, the same for the megatron actor's
  ``GPTModel`` (the model is the megatron actor worker's policy view);
- ``auto``: :func:`auto_engine_name` picks one of them for the model (the megatron actor worker applies its own
  rule for its policy: ``megatron`` where the model allows it, SDPA attention and no pipeline or sequence
  parallelism, else ``reference``).

Registering your own (an adapter to vLLM, SGLang...)::

    from ppo_core.rollout import register_rollout_engine

    @register_rollout_engine("vllm")
    def build_vllm(model, config):
        return MyVLLMEngine(model, config)  # implements RolloutEngine (and WeightReceiver if it copies weights)

then set ``actor.worker.rollout.engine: vllm`` in a trainer config (the module that registers it must be imported
first, e.g. by your entry point), or pass ``SamplingConfig(engine="vllm")`` to :func:`generate`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "AUTO",
    "EngineFactory",
    "auto_engine_name",
    "get_rollout_engine",
    "register_rollout_engine",
    "resolve_engine",
    "rollout_engine_names",
]

AUTO = "auto"
"""The engine name that lets :func:`auto_engine_name` choose."""

EngineFactory = Callable[[nn.Module, Any], Any]
"""``factory(model, config: SamplingConfig) -> RolloutEngine``."""

_FACTORIES: dict[str, EngineFactory | str] = {
    # built-ins by "module:attribute", imported when first built (the decode engines need transformers / megatron)
    "reference": "ppo_core.rollout.engine:reference_engine",
    "hf": "ppo_core_decode.hf:hf_engine",
    "megatron": "ppo_core.workers.megatron.rollout:megatron_engine",
}


def register_rollout_engine(name: str, *, replace: bool = False) -> Callable[[EngineFactory], EngineFactory]:
    """Register ``factory(model, config) -> RolloutEngine`` under ``name`` (a decorator; returns the factory).

    Raises ``ValueError`` for the reserved name ``auto``, an empty name, or a name already registered (unless
    ``replace=True``).

    Example:
        >>> from ppo_core.rollout.engine import ModelRolloutEngine
        >>> @register_rollout_engine("doc_example", replace=True)
        ... def build(model, config):
        ...     return ModelRolloutEngine(model)
        >>> "doc_example" in rollout_engine_names()
        True
    """
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(
            f"a rollout engine's name must be a non-empty string other than {AUTO!r}, got {name!r}"
        )

    def register(factory: EngineFactory) -> EngineFactory:
        if not callable(factory):
            raise TypeError(
                f"rollout engine {name!r}: the factory must be callable, got {type(factory).__name__}"
            )
        if name in _FACTORIES and not replace:
            raise ValueError(
                f"rollout engine {name!r} is already registered (pass replace=True to replace it)"
            )
        _FACTORIES[name] = factory
        return factory

    return register


def rollout_engine_names() -> tuple[str, ...]:
    """The registered names, sorted (``auto`` is not among them: it names one of these)."""
    return tuple(sorted(_FACTORIES))


def check_engine_name(name: str, path: str = "engine") -> str:
    """``name`` if it is ``auto`` or registered, else ``ValueError`` naming ``path`` and listing the valid names."""
    if name != AUTO and name not in _FACTORIES:
        valid = ", ".join((AUTO, *rollout_engine_names()))
        raise ValueError(f"{path}={name!r} is not a rollout engine; valid names: {valid}")
    return name


def get_rollout_engine(name: str) -> EngineFactory:
    """The factory registered under ``name`` (``ValueError`` listing the valid names otherwise)."""
    if name == AUTO or name not in _FACTORIES:
        check_engine_name(name)
        raise ValueError(f"{AUTO!r} names no factory: resolve it with auto_engine_name(model) first")
    factory = _FACTORIES[name]
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory


def auto_engine_name(model: nn.Module, *, use_cache: bool = True) -> str:
    """The engine ``auto`` picks for ``model``:

    1. the model's own choice, when it has an ``auto_rollout_engine`` attribute (a string: a model class that
       knows its engine says so);
    2. ``hf`` for a Hugging Face causal LM (a ``transformers.PreTrainedModel`` with an ``lm_head``, or a wrapper
       holding one as ``.model``) when ``use_cache``;
    3. ``reference`` otherwise.

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> auto_engine_name(TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2)))
        'reference'
    """
    own = getattr(model, "auto_rollout_engine", None)
    if isinstance(own, str):
        return own
    if use_cache and hf_causal_lm(model) is not None:
        return "hf"
    return "reference"


def resolve_engine(name: str, model: nn.Module, *, use_cache: bool = True) -> str:
    """``name``, or for ``auto`` the name :func:`auto_engine_name` picks for ``model`` (``ValueError`` for an
    unregistered name)."""
    check_engine_name(name)
    return auto_engine_name(model, use_cache=use_cache) if name == AUTO else name


def build_rollout_engine(name: str, model: nn.Module, config: Any) -> Any:
    """The engine ``name`` (``auto`` resolved for ``model`` and ``config.use_cache``) built for ``model``."""
    resolved = resolve_engine(name, model, use_cache=getattr(config, "use_cache", True))
    return get_rollout_engine(resolved)(model, config)


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
