"""From a :class:`~ppo_core_cli.config.JobConfig` to the pieces of a run: model directory, tokenizer, prompts,
reward, completed worker settings, worker specs and the trainer (local or Monarch).

Nothing here trains; :mod:`ppo_core_cli.train` strings the pieces together.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers import WorkerSpec
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig
from ppo_core_cli.config import JobConfig, ScorerConfig
from ppo_core_cli.tokens import SpecialTokens, check_vocabulary_fits, resolve_special_tokens
from ppo_core_cli.worker_kinds import worker_kind

__all__ = [
    "LocalTrainer",
    "build_reward",
    "build_trainer",
    "check_tokenizer_fits",
    "checkpoint_dir_of",
    "complete_workers",
    "load_datasets",
    "load_prompts",
    "load_tokenizer",
    "prepare_model",
    "resolve_model_dirs",
    "resolve_scorer",
    "resolve_scorers",
    "scorer_search_path",
    "special_tokens",
    "worker_specs",
]

logger = logging.getLogger(__name__)


def prepare_model(job: JobConfig) -> str:
    """The Hugging Face checkpoint directory of ``model.path``: the directory itself; the converted checkpoint of a
    GGUF file (or of a directory holding one: :func:`~ppo_core_cli.convert.converted_checkpoint`, reused once
    converted); or a random-init checkpoint written there when ``model.init_shape`` asks for one."""
    path = job.model.path
    if not path:
        raise ValueError("model.path must name a Hugging Face checkpoint directory or a GGUF file")
    converted = checkpoint_dir_of(job, path, "model.path")
    if converted != path:
        return converted
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if job.model.init_shape is None:
        raise FileNotFoundError(
            f"model.path={path!r} is neither a Hugging Face checkpoint directory (no config.json) nor a GGUF "
            "file; set model.init_shape to create a random-init checkpoint there"
        )
    if not job.model.tokenizer_path:
        raise ValueError("model.init_shape needs model.tokenizer_path (where the tokenizer files are)")
    from ppo_core_cli.shapes import write_random_checkpoint

    return write_random_checkpoint(
        path, job.model.init_shape, job.model.tokenizer_path, seed=job.model.init_seed, dtype=job.model.dtype
    )


def checkpoint_dir_of(job: JobConfig, path: str, key: str) -> str:
    """``path``, or the converted checkpoint (``model.convert_dir``, ``model.dtype``) of the GGUF file it names;
    ``key`` (the config key of ``path``) is named in the errors."""
    from ppo_core_cli.convert import converted_checkpoint, find_gguf_file

    try:
        gguf_file = find_gguf_file(path)
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"{key}: {exc}") from None
    if gguf_file is None:
        return path
    return converted_checkpoint(gguf_file, job.model.convert_dir, dtype=job.model.dtype)


def resolve_model_dirs(job: JobConfig) -> JobConfig:
    """``job`` with ``model.path`` (and ``model.critic_path``) naming Hugging Face checkpoint directories: GGUF
    files converted (or their earlier conversion reused), a random-init checkpoint written where asked. Everything
    after reads the returned job (workers, ``job.yaml``, the export)."""
    model_dir = prepare_model(job)
    critic = job.model.critic_path
    if critic:
        critic = checkpoint_dir_of(job, critic, "model.critic_path")
    return dataclasses.replace(job, model=dataclasses.replace(job.model, path=model_dir, critic_path=critic))


def load_tokenizer(job: JobConfig) -> Any:
    """The checkpoint's tokenizer (``model.tokenizer_path`` or ``model.path``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(job.model.tokenizer_dir, local_files_only=True)


def special_tokens(job: JobConfig, tokenizer: Any) -> SpecialTokens:
    """The run's EOS and padding (:func:`ppo_core_cli.tokens.resolve_special_tokens` with ``model.eos_token``,
    ``model.pad_token`` and ``data.chat_template_kwargs``), logged once."""
    return resolve_special_tokens(
        tokenizer,
        eos_token=job.model.eos_token,
        pad_token=job.model.pad_token,
        chat_template_kwargs=job.data.chat_template_kwargs,
        where=job.model.tokenizer_dir,
    )


def check_tokenizer_fits(job: JobConfig, tokenizer: Any) -> None:
    """``ValueError`` when the tokenizer has more tokens than the actor's (or the critic's) embedding has rows."""
    for model_dir in dict.fromkeys([job.model.path, job.model.critic_dir]):
        check_vocabulary_fits(tokenizer, job.model.tokenizer_dir, model_dir)


def load_prompts(job: JobConfig, tokenizer: Any, files: list[str]) -> Any:
    """The prompt dataset of ``files`` (``data.train_files`` or ``data.val_files``) under the job's ``data``
    settings: prompt length, truncation, prompt key, chat-template variables."""
    from ppo_core.data import load_prompt_dataset

    data = job.data
    return load_prompt_dataset(
        files,
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        prompt_key=data.prompt_key,
        chat_template_kwargs=data.chat_template_kwargs,
    )


def load_datasets(job: JobConfig, tokenizer: Any) -> tuple[Any, Any]:
    """``(train, validation or None)`` prompt datasets of ``data.train_files`` / ``data.val_files``."""
    data = job.data
    if not data.train_files:
        raise ValueError("data.train_files must name at least one prompt file")
    train = load_prompts(job, tokenizer, data.train_files)
    val = load_prompts(job, tokenizer, data.val_files) if data.val_files else None
    return train, val


def scorer_search_path(config_path: str | os.PathLike[str] | None = None) -> list[str]:
    """Where ``module:function`` scorers are imported from, first to last: the config file's directory (when
    given), then the working directory; both ahead of the installed packages, as Python puts a script's own
    directory first."""
    dirs = [os.path.dirname(os.path.abspath(config_path))] if config_path is not None else []
    dirs.append(os.getcwd())
    return list(dict.fromkeys(dirs))


def _put_on_import_path(dirs: Sequence[str]) -> None:
    """Put ``dirs`` first on ``sys.path``, in order (one already there stays where it is). ``spawn``ed reward
    workers inherit ``sys.path``, so they import the same scorer modules."""
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    missing = [d for d in dirs if d not in present]
    sys.path[:0] = missing
    if missing:
        importlib.invalidate_caches()


def resolve_scorer(
    spec: ScorerConfig, *, key: str = "function", search_path: Sequence[str] | None = None
) -> Any:
    """The scorer of ``spec``: a built-in (``gsm8k``, ``math``) or ``module:function``, with its kwargs bound.

    Args:
        spec: the scorer's config.
        key: its dotted key in the job (``reward.scorers.<pattern>.function``), named in errors.
        search_path: the directories searched for the module before the installed packages (see
            :func:`scorer_search_path`, the default); they are put on ``sys.path``.

    Raises:
        ValueError: one line naming ``key``, the module, the directories searched and the underlying error (the
            module is missing, raises on import, lacks the function); or the function cannot be called as a
            scorer with these kwargs.
    """
    from ppo_core.rewards import gsm8k_score, math_score

    builtins = {"gsm8k": gsm8k_score, "math": math_score}
    where = f"{key}={spec.function!r}"
    if spec.function in builtins:
        fn = builtins[spec.function]
    else:
        module_name, _, name = spec.function.partition(":")
        if not module_name or not name:
            raise ValueError(f"{where} must be 'module:function' (both parts non-empty)")
        dirs = scorer_search_path() if search_path is None else list(search_path)
        _put_on_import_path(dirs)
        # a missing module, or one that fails on import (SyntaxError, its own imports...): one line either way
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            looked = ", ".join(dirs) + (", then " if dirs else "") + "the installed packages"
            raise ValueError(
                f"{where}: cannot import module {module_name!r} (looked in {looked}): {type(exc).__name__}: "
                f"{_one_line(exc)}"
            ) from None
        fn = module
        for part in name.split("."):
            if not hasattr(fn, part):
                raise ValueError(
                    f"{where}: module {module_name!r} ({getattr(module, '__file__', None) or 'no file'}) has no "
                    f"attribute {name!r}"
                )
            fn = getattr(fn, part)
        if not callable(fn):
            raise ValueError(f"{where} is not callable: a {type(fn).__name__}")
    _check_signature(fn, spec, key)
    return functools.partial(fn, **spec.kwargs) if spec.kwargs else fn


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"


def _check_signature(fn: Any, spec: ScorerConfig, key: str) -> None:
    """The scorer is called as ``fn(solution_str, ground_truth, extra_info, **kwargs)``: check that it can be."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some C callables): it shows at the first call
        return
    try:
        signature.bind("", "", None, **spec.kwargs)
    except TypeError as exc:
        where = f"{key}={spec.function!r}"
        if spec.kwargs and _binds(signature):  # the function takes the three arguments: the kwargs are wrong
            where = f"{key.rpartition('.')[0] or 'scorer'}.kwargs={spec.kwargs}"
        raise ValueError(
            f"{where}: {spec.function}{signature} cannot be called as a scorer, "
            f"fn(solution_str, ground_truth, extra_info, **kwargs): {exc}"
        ) from None


def _binds(signature: inspect.Signature) -> bool:
    """Whether ``signature`` takes ``(solution_str, ground_truth, extra_info)`` without any kwargs."""
    try:
        signature.bind("", "", None)
    except TypeError:
        return False
    return True


def resolve_scorers(job: JobConfig, config_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{pattern: scorer}`` of ``reward.scorers``, every one imported and checked now (before any model loads).

    ``module:function`` scorers are imported from ``config_path``'s directory, then the working directory, then
    the installed packages (:func:`scorer_search_path`). Errors (``ValueError``) name the scorer's dotted key.
    """
    dirs = scorer_search_path(config_path)
    return {
        pattern: resolve_scorer(spec, key=f"reward.scorers.{pattern}.function", search_path=dirs)
        for pattern, spec in job.reward.scorers.items()
    }


def build_reward(job: JobConfig, tokenizer: Any, scorers: Mapping[str, Any] | None = None) -> Any:
    """The trainer's reward function: a :class:`~ppo_core.rewards.RuleBasedReward` with the job's scorers
    (``scorers``: already resolved by :func:`resolve_scorers`; None resolves them here)."""
    from ppo_core.rewards import RuleBasedReward

    if scorers is None:
        scorers = resolve_scorers(job)
    return RuleBasedReward(
        tokenizer, num_workers=job.reward.num_workers, scorers=scorers, timeout_s=job.reward.timeout_s
    )


def check_data_sources(reward: Any, datasets: Mapping[str, Any]) -> None:
    """Every ``data_source`` of the prompt datasets (``{config key: dataset}``) has a scorer in ``reward`` (a
    :class:`~ppo_core.rewards.RuleBasedReward`): one that has none is named with the file key and what to add to the
    job, before any model loads (the run would otherwise stop at the first step scoring it)."""
    registry = getattr(reward, "registry", None)
    if registry is None:
        return
    for key, dataset in datasets.items():
        if dataset is None:
            continue
        sources = sorted({str(item.get("data_source")) for item in dataset})
        missing = [source for source in sources if registry.find(source) is None]
        if missing:
            raise ValueError(
                f"{key}: no scorer for data_source {', '.join(repr(m) for m in missing)}; give one in the job, "
                f"reward.scorers: {{{missing[0]!r}: {{function: my_module:score}}}} (a function of "
                f"(solution_str, ground_truth, extra_info) in a file next to the job), or use a data_source "
                f"scored out of the box: {', '.join(registry.patterns())}"
            )


def complete_workers(
    job: JobConfig, tokenizer: Any, model_dir: str, tokens: SpecialTokens | None = None
) -> tuple[PPOActorConfig, PPOCriticConfig]:
    """The actor's and the critic's worker configs as the workers receive them
    (:meth:`~ppo_core_cli.config.JobConfig.resolved_workers`): the rollout's ``eos_token_id`` and ``pad_token_id``
    from ``tokens`` (the run's resolved EOS and padding; None: resolved here from ``tokenizer``) where ``rollout``
    leaves them None, and what each worker kind's config reads from ``model_dir`` (e.g. the megatron model shape,
    ``hf_checkpoint`` and the critic's value-head initialisation)."""
    tokens = tokens or special_tokens(job, tokenizer)
    return job.resolved_workers(model_dir, eos_token_id=tokens.eos_token_id, pad_token_id=tokens.pad_token_id)


def worker_specs(job: JobConfig, ppo: PPOConfig, model_dir: str) -> dict[str, WorkerSpec]:
    """``{"actor": spec, "critic": spec}`` (the critic only when the config uses one) for the job's workers: built
    by the ``workers`` kind (:mod:`ppo_core_cli.worker_kinds`)."""
    return worker_kind(job.workers).build_specs(job, ppo, model_dir)


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
