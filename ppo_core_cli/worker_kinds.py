"""Kinds of workers by name (a job's ``workers`` key): their config classes and how the command builds them.

A kind pairs the actor's and the critic's config classes (subclasses of
:class:`~ppo_core.workers.config.PPOActorConfig` / :class:`~ppo_core.workers.config.PPOCriticConfig`) with a
function that builds the :class:`~ppo_core.workers.WorkerSpec` of each role. Everything that differs between kinds
lives in those classes: which keys the run sets (:attr:`~ppo_core.workers.config.PPOWorkerConfig.RUN_KEYS`), how a
config completes itself from the checkpoint (:meth:`~ppo_core.workers.config.PPOWorkerConfig.resolved`), the
data-parallel size of a group. So the command has no branch per kind: ``torch`` and ``megatron`` are registered
here, and :func:`register_worker_kind` adds your own.

Example:
    >>> worker_kind("torch").actor_config.__name__
    'TorchActorConfig'
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

if TYPE_CHECKING:
    from ppo_core.trainer import PPOConfig
    from ppo_core.workers import WorkerSpec
    from ppo_core_cli.config import JobConfig

__all__ = ["WorkerKind", "register_worker_kind", "worker_kind", "worker_kind_names"]

SpecBuilder = Callable[["JobConfig", "PPOConfig", str], "dict[str, WorkerSpec]"]
"""``(job, the trainer's config with the resolved worker configs, model directory) -> {"actor": spec, "critic":
spec}`` (the critic only when ``ppo.use_critic``)."""


@dataclass(frozen=True)
class WorkerKind:
    """One kind of workers a job can name."""

    name: str
    """The value of the job's ``workers`` key."""
    actor_config: type[PPOActorConfig]
    """Config class of the actor worker (``actor.worker``)."""
    critic_config: type[PPOCriticConfig]
    """Config class of the critic worker (``critic.worker``)."""
    build_specs: SpecBuilder
    """Builds the worker specs of a run (see :data:`SpecBuilder`)."""
    description: str = ""
    """One line for the docs."""
    needs_cuda: bool = False
    """The workers train on CUDA devices only (megatron-core's DDP and optimizer allocate their buffers there):
    ``ppo-core train`` and ``eval`` refuse the job on a machine without CUDA before anything loads."""
    optimizer_in_model_dtype: bool = False
    """The workers train the model's own parameters in ``model.dtype`` with their optimiser state in it too (no
    float32 master copy): a float16 job needs an ``optim.eps`` that float16 represents, checked when it is read."""
    loads_with_attn_implementation: bool = False
    """The workers load ``transformers`` models with ``model.attn_implementation``: an unknown one, or one whose
    package is missing, is refused before anything loads."""

    def config_class(self, role: str) -> type[PPOActorConfig] | type[PPOCriticConfig]:
        """The config class of ``role`` (``actor`` or ``critic``)."""
        return self.actor_config if role == "actor" else self.critic_config


_KINDS: dict[str, WorkerKind] = {}


def register_worker_kind(kind: WorkerKind, *, replace: bool = False) -> WorkerKind:
    """Make ``kind`` available as ``workers: <kind.name>``; ``ValueError`` when the name is taken (unless
    ``replace``)."""
    if not kind.name or not isinstance(kind.name, str):
        raise ValueError(f"a worker kind needs a non-empty name, got {kind.name!r}")
    if kind.name in _KINDS and not replace:
        raise ValueError(f"worker kind {kind.name!r} is already registered (pass replace=True to replace it)")
    _KINDS[kind.name] = kind
    return kind


def worker_kind(name: str) -> WorkerKind:
    """The registered kind ``name``; ``ValueError`` listing the registered ones otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown workers {name!r}; valid values: {', '.join(worker_kind_names())}"
        ) from None


def worker_kind_names() -> list[str]:
    """The registered kinds, sorted."""
    return sorted(_KINDS)


def _torch_specs(job: JobConfig, ppo: PPOConfig, model_dir: str) -> dict[str, WorkerSpec]:
    from ppo_core.models.hf import load_causal_lm, load_value_model
    from ppo_core.workers import WorkerSpec
    from ppo_core_cli.workers import TorchActor, TorchCritic

    m = job.model
    policy = functools.partial(
        load_causal_lm, model_dir, dtype=m.dtype, attn_implementation=m.attn_implementation
    )
    value = functools.partial(
        load_value_model,
        m.critic_path or model_dir,
        dtype=m.dtype,
        attn_implementation=m.attn_implementation,
        head_init_std=m.value_head_init_std,
        seed=m.init_seed,
    )
    specs = {"actor": WorkerSpec(TorchActor, (policy, ppo.actor.worker))}
    if ppo.use_critic:
        specs["critic"] = WorkerSpec(TorchCritic, (value, ppo.critic.worker))
    return specs


def _megatron_specs(job: JobConfig, ppo: PPOConfig, model_dir: str) -> dict[str, WorkerSpec]:
    from ppo_core.workers import WorkerSpec
    from ppo_core_cli._megatron_workers import MegatronActor, MegatronCritic

    specs = {"actor": WorkerSpec(MegatronActor, kwargs={"config": ppo.actor.worker})}
    if ppo.use_critic:
        specs["critic"] = WorkerSpec(MegatronCritic, kwargs={"config": ppo.critic.worker})
    return specs


register_worker_kind(
    WorkerKind(
        "torch",
        TorchActorConfig,
        TorchCriticConfig,
        _torch_specs,
        "any Hugging Face causal LM, DDP",
        optimizer_in_model_dtype=True,
        loads_with_attn_implementation=True,
    )
)
register_worker_kind(
    WorkerKind(
        "megatron",
        MegatronActorConfig,
        MegatronCriticConfig,
        _megatron_specs,
        "Llama/Qwen2 on megatron-core; CUDA",
        needs_cuda=True,
    )
)
