"""From a :class:`~ppo_core_cli.config.JobConfig` to the pieces of a run: model directory, tokenizer, prompts,
reward, completed worker settings, worker specs and the trainer (local or Monarch).

Nothing here trains; :mod:`ppo_core_cli.train` strings the pieces together.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers import WorkerSpec
from ppo_core_cli.config import JobConfig, ScorerConfig

__all__ = [
    "LocalTrainer",
    "build_reward",
    "build_trainer",
    "complete_workers",
    "load_datasets",
    "load_tokenizer",
    "prepare_model",
    "resolve_scorer",
    "worker_specs",
]

logger = logging.getLogger(__name__)


def prepare_model(job: JobConfig) -> str:
    """``model.path``, after writing a random-init checkpoint there when ``model.init_shape`` asks for one."""
    path = job.model.path
    if not path:
        raise ValueError("model.path must name a Hugging Face checkpoint directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if job.model.init_shape is None:
        raise FileNotFoundError(
            f"model.path={path!r} is not a Hugging Face checkpoint directory (no config.json); set "
            "model.init_shape to create a random-init one there"
        )
    if not job.model.tokenizer_path:
        raise ValueError("model.init_shape needs model.tokenizer_path (where the tokenizer files are)")
    from ppo_core_cli.shapes import write_random_checkpoint

    return write_random_checkpoint(
        path, job.model.init_shape, job.model.tokenizer_path, seed=job.model.init_seed, dtype=job.model.dtype
    )


def load_tokenizer(job: JobConfig) -> Any:
    """The checkpoint's tokenizer (``model.tokenizer_path`` or ``model.path``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model.tokenizer_dir, local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {job.model.tokenizer_dir!r} has neither a pad nor an EOS token")
    return tokenizer


def pad_token_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's pad token, else its EOS (as for Llama tokenizers)."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def load_datasets(job: JobConfig, tokenizer: Any) -> tuple[Any, Any]:
    """``(train, validation or None)`` prompt datasets of ``data.train_files`` / ``data.val_files``."""
    from ppo_core.data import load_prompt_dataset

    data = job.data
    if not data.train_files:
        raise ValueError("data.train_files must name at least one prompt file")
    kwargs = dict(
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        prompt_key=data.prompt_key,
        chat_template_kwargs=data.chat_template_kwargs,
    )
    train = load_prompt_dataset(data.train_files, tokenizer, **kwargs)
    val = load_prompt_dataset(data.val_files, tokenizer, **kwargs) if data.val_files else None
    return train, val


def resolve_scorer(spec: ScorerConfig) -> Any:
    """The scorer of ``spec``: a built-in (``gsm8k``, ``math``) or ``module:function``, with its kwargs bound."""
    from ppo_core.rewards import gsm8k_score, math_score

    builtins = {"gsm8k": gsm8k_score, "math": math_score}
    if spec.function in builtins:
        fn = builtins[spec.function]
    else:
        module, _, name = spec.function.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer function {spec.function!r} cannot be imported: {exc}") from None
        if not callable(fn):
            raise TypeError(f"scorer function {spec.function!r} is not callable")
    return functools.partial(fn, **spec.kwargs) if spec.kwargs else fn


def build_reward(job: JobConfig, tokenizer: Any) -> Any:
    """The trainer's reward function: a :class:`~ppo_core.rewards.RuleBasedReward` with the job's scorers."""
    from ppo_core.rewards import RuleBasedReward

    scorers = {pattern: resolve_scorer(spec) for pattern, spec in job.reward.scorers.items()}
    return RuleBasedReward(tokenizer, num_workers=job.reward.num_workers, scorers=scorers)


def _with_defaults(section: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {**defaults, **section}


def complete_workers(job: JobConfig, tokenizer: Any, model_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The actor and critic worker dicts as the workers receive them.

    Added where the job does not set them: the rollout's ``eos_token_id`` and ``pad_token_id`` (from the
    tokenizer). Megatron workers also get the model shape of ``model_dir``'s config in ``model.dtype``
    (:func:`~ppo_core.workers.megatron.hf_config.model_config_from_hf`, with the job's other ``model`` keys),
    ``hf_checkpoint`` (the actor: ``model_dir``; the critic: ``model.critic_path`` or ``model_dir``), the whole
    ``parallel`` layout (so that an export can read the rank files) and, for the critic, the value head's
    initialisation (``model.value_head_init_std``, seeded by ``model.init_seed``, as the torch critic's).
    """
    actor = dict(job.actor.worker)
    critic = dict(job.critic.worker)
    sampling = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad_token_id(tokenizer)}
    actor["rollout"] = _with_defaults(actor.get("rollout") or {}, sampling)
    if job.workers == "megatron":
        from transformers import AutoConfig

        from ppo_core.workers.megatron.config import ParallelConfig
        from ppo_core.workers.megatron.hf_config import model_config_from_hf

        for worker, path in ((actor, model_dir), (critic, job.model.critic_path or model_dir)):
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
            extra = dict(worker.get("model") or {})
            worker["model"] = model_config_from_hf(hf_config, dtype=job.model.dtype, **extra).to_dict()
            worker["hf_checkpoint"] = path
            worker["parallel"] = ParallelConfig.from_dict(worker.get("parallel") or {}).to_dict()
        critic.setdefault("value_head_init_std", job.model.value_head_init_std)
        critic.setdefault("value_head_seed", job.model.init_seed)
    return actor, critic


def worker_specs(job: JobConfig, ppo: PPOConfig, model_dir: str) -> dict[str, WorkerSpec]:
    """``{"actor": spec, "critic": spec}`` (the critic only when the config uses one) for the job's workers."""
    if job.workers == "torch":
        from ppo_core.models.hf import load_causal_lm, load_value_model
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
    from ppo_core_cli._megatron_workers import MegatronActor, MegatronCritic

    specs = {"actor": WorkerSpec(MegatronActor, kwargs={"config": ppo.actor.worker})}
    if ppo.use_critic:
        specs["critic"] = WorkerSpec(MegatronCritic, kwargs={"config": ppo.critic.worker})
    return specs


class LocalTrainer(BasePPOTrainer):
    """:class:`BasePPOTrainer` with each role in a :class:`~ppo_core.backends.local.LocalWorkerGroup` (this process)."""

    def __init__(self, config: PPOConfig, *, roles: Mapping[str, WorkerSpec], **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._roles = dict(roles)

    def init_workers(self) -> None:
        from ppo_core.backends.local import LocalWorkerGroup

        self.actor_wg = LocalWorkerGroup(self._roles["actor"])
        if "critic" in self._roles:
            self.critic_wg = LocalWorkerGroup(self._roles["critic"])


def _share_import_path() -> None:
    """Put the directory this package is imported from on ``PYTHONPATH``: Monarch's processes unpickle the worker
    classes by module name, and a source checkout run from its root is importable here only through the working
    directory, which they do not put on their path."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


def build_trainer(
    job: JobConfig, ppo: PPOConfig, roles: Mapping[str, WorkerSpec], **kwargs: Any
) -> BasePPOTrainer:
    """The trainer of ``job.backend`` over ``roles`` (``kwargs``: datasets, reward, padding id)."""
    if job.backend == "local":
        return LocalTrainer(ppo, roles=roles, **kwargs)
    _share_import_path()
    import ppo_core_monarch  # noqa: F401  (before monarch: it sets the supervision poll)
    from ppo_core._config_base import _nested
    from ppo_core_monarch import MonarchConfig
    from ppo_core_monarch.trainer import MonarchPPOTrainer

    monarch = _nested("monarch", lambda: MonarchConfig.from_dict(job.monarch))
    return MonarchPPOTrainer(
        ppo,
        roles=dict(roles),
        procs_per_host=job.actor.world_size,
        monarch=monarch,
        colocate=job.colocate,
        **kwargs,
    )
