"""``JobConfig``: everything one ``ppo-core`` run reads, as one typed config.

A job is the trainer's :class:`~ppo_core.trainer.PPOConfig` (sections ``data``, ``actor``, ``critic``, ``rollout``,
``algorithm``, ``trainer``) plus what the command needs around it: the model directory (``model``), the prompt
files (more fields in ``data``), the reward (``reward``), the format warm-up (``sft``), the backend and workers,
the run directory and the export. The worker settings (``actor.worker``, ``critic.worker``) are checked against
the chosen workers' config class (:class:`~ppo_core.workers.torch.TorchActorConfig` or
:class:`~ppo_core.workers.megatron.MegatronActorConfig`...: :mod:`ppo_core_cli.worker_kinds`) and become instances
of it when the job is built, so a typo fails before any model loads. Every setting has one key: the sampling sits
in ``rollout`` with ``rollout.n``, the KL-loss switch is ``actor.use_kl_loss`` (the old keys are deprecated
aliases: :mod:`ppo_core_cli.aliases`). The rules between sections (mini-batches and ``train_batch_size x n``, the
reference that a KL term needs, the parallel layout and the world size) are checked when the job is built.

:func:`ppo_core_cli.loading.load_job_config` builds one from a YAML file and Hydra-style ``key=value`` overrides.
Every error names the dotted key: an unknown key lists the valid keys at that level, a value of the wrong type says
what was expected.

Paths: ``trainer.default_local_dir`` (checkpoints), ``trainer.log_dir`` (metrics; None: ``run_dir``) and
``export_dir`` are resolved under ``run_dir`` when relative; every other path is relative to the working
directory.

Example:
    >>> job = JobConfig.from_dict({"model": {"path": "m"}, "trainer": {"total_training_steps": 5}})
    >>> job.trainer.total_training_steps, job.checkpoint_dir, type(job.actor.worker).__name__
    (5, 'runs/ppo/checkpoints', 'TorchActorConfig')
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo_core._checks import FieldTypeError, FieldValueError, _FieldError, check_int, check_positive
from ppo_core._config_base import ConfigBase, _nested
from ppo_core.data.prompts import TRUNCATION_POLICIES
from ppo_core.trainer.config import ActorConfig, CriticConfig, DataConfig, PPOConfig
from ppo_core.trainer.presets import PRESETS
from ppo_core.workers.config import ModelSource, PPOActorConfig, PPOCriticConfig
from ppo_core_cli.aliases import ALIASES, canonical_job_tree
from ppo_core_cli.roles import JobActorConfig, JobCriticConfig, JobRolloutConfig
from ppo_core_cli.worker_kinds import worker_kind, worker_kind_names

__all__ = [
    "INIT_SHAPES",
    "JobActorConfig",
    "JobConfig",
    "JobCriticConfig",
    "JobDataConfig",
    "JobModelConfig",
    "JobRolloutConfig",
    "RewardConfig",
    "SFTConfig",
    "ScorerConfig",
    "worker_config_classes",
]

Backend = Literal["local", "monarch"]
Truncation = Literal["error", "filter", "left", "right"]
DType = Literal["float32", "bfloat16", "float16"]
InitShape = Literal["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b"]
INIT_SHAPES: tuple[str, ...] = typing.get_args(InitShape)
"""Values of ``model.init_shape`` (see :mod:`ppo_core_cli.shapes`)."""

assert set(typing.get_args(Truncation)) == set(TRUNCATION_POLICIES)


@dataclass(kw_only=True)
class JobModelConfig(ConfigBase):
    """The Hugging Face checkpoint the actor, the reference and the critic start from."""

    path: str = ""
    """Checkpoint directory (``config.json``, safetensors, tokenizer files), or a GGUF file (or a directory holding
    exactly one ``*.gguf``): converted once into a checkpoint under ``convert_dir`` (see
    :mod:`ppo_core_cli.convert`); local only, nothing is downloaded."""
    convert_dir: str | None = None
    """Where GGUF files are converted into Hugging Face checkpoints and reused from (one folder per file and
    dtype); None: ``$XDG_CACHE_HOME/ppo-core/converted`` (``~/.cache/ppo-core/converted``)."""
    eos_token: str | None = None
    """The token that ends a response (a token string of the vocabulary); None: the one that ends an assistant
    turn in the chat template, else the tokenizer's EOS (see :mod:`ppo_core_cli.tokens`)."""
    pad_token: str | None = None
    """The padding token; None: the tokenizer's pad token when it is a special token, else the EOS."""
    tokenizer_path: str | None = None
    """Directory of the tokenizer files; None: ``path``."""
    critic_path: str | None = None
    """Checkpoint the critic's body starts from (a fresh value head is added); None: ``path``."""
    init_shape: InitShape | None = None
    """When set and ``path`` holds no ``config.json``: first write a randomly initialised Qwen2 checkpoint of this
    shape there (``tiny``, ``qwen2.5-0.5b``, ``qwen2.5-1.5b``), with the tokenizer of ``tokenizer_path`` (required
    then). For benchmarks and offline machines: no hub needed."""
    init_seed: int = 0
    """Seed of that random initialisation."""
    dtype: DType = "float32"
    """Parameter dtype of the models: the torch workers load the checkpoint in it, the megatron workers build
    their model in it (``bfloat16`` on GPUs)."""
    attn_implementation: str | None = "sdpa"
    """``transformers`` attention of the torch workers (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    value_head_init_std: float = 0.0
    """Standard deviation of the critic's new value head (0: zeros, every value starts at 0)."""

    def __post_init__(self) -> None:
        check_int("init_seed", self.init_seed, 0)
        check_positive("value_head_init_std", self.value_head_init_std, allow_zero=True)

    @property
    def tokenizer_dir(self) -> str:
        """Where the tokenizer files are."""
        return self.tokenizer_path or self.path

    @property
    def critic_dir(self) -> str:
        """Where the critic starts from."""
        return self.critic_path or self.path


@dataclass(kw_only=True)
class JobDataConfig(DataConfig):
    """The trainer's data settings plus the prompt files (verl's schema; see :mod:`ppo_core.data`)."""

    train_files: list[str] = field(default_factory=list)
    """Training prompts: parquet / JSON Lines files in verl's schema, concatenated."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompts (empty: no validation)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, after the chat template."""
    truncation: Truncation = "error"
    """A longer prompt: ``error``, ``filter`` (drop it), ``left`` (keep its end) or ``right`` (keep its start)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template (e.g. ``{enable_thinking: false}``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("max_prompt_length", self.max_prompt_length, 1)

    def trainer_data(self) -> DataConfig:
        """The :class:`DataConfig` part (what the trainer reads)."""
        names = [f.name for f in dataclasses.fields(DataConfig)]
        return DataConfig(**{name: getattr(self, name) for name in names})


@dataclass(kw_only=True)
class ScorerConfig(ConfigBase):
    """One rule-based scorer: a function and fixed keyword arguments."""

    function: str = "gsm8k"
    """``gsm8k`` (:func:`ppo_core.rewards.gsm8k_score`), ``math`` (:func:`ppo_core.rewards.math_score`) or
    ``module:function`` (your own; called as ``function(solution_str, ground_truth, extra_info, **kwargs)``,
    returning a float or a dict with a ``score`` float; the module is imported from the config file's directory,
    then the working directory, then the installed packages)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to it (e.g. ``{method: flexible, format_score: 0.1}`` for ``gsm8k``)."""

    def __post_init__(self) -> None:
        if not self.function or (":" not in self.function and self.function not in ("gsm8k", "math")):
            raise FieldValueError(
                "function", f" must be 'gsm8k', 'math' or 'module:function', got {self.function!r}"
            )


@dataclass(kw_only=True)
class RewardConfig(ConfigBase):
    """The rule-based reward (:class:`ppo_core.rewards.RuleBasedReward`): scorers picked by ``data_source``."""

    num_workers: int = 0
    """Score in a pool of this many processes (overlapping the log-prob passes); 0: in the controller."""
    scorers: dict[str, ScorerConfig] = field(default_factory=dict)
    """``{data_source pattern: scorer}`` taking precedence over the built-in registry (``*gsm8k*``, MATH names)."""
    timeout_s: float | None = 60.0
    """Seconds each scorer call (one response) may take; past it the run stops with an error naming the scorer,
    the data source and the step. None: no deadline."""

    def __post_init__(self) -> None:
        check_int("num_workers", self.num_workers, 0)
        if self.timeout_s is not None:
            check_positive("timeout_s", self.timeout_s)


@dataclass(kw_only=True)
class SFTConfig(ConfigBase):
    """``ppo-core sft``: a short supervised warm-up on prompt/response pairs, written as a new checkpoint."""

    model_path: str = ""
    """Checkpoint to start from (model and tokenizer); a GGUF file is converted as ``model.path`` is."""
    files: list[str] = field(default_factory=list)
    """Parquet / JSON Lines files of pairs: chat messages in ``prompt_key``, the response text in ``response_key``."""
    output_dir: str = ""
    """Where the warmed-up Hugging Face checkpoint (model and tokenizer) is written."""
    prompt_key: str = "prompt"
    """Column of the chat messages."""
    response_key: str = "response"
    """Column of the response text (the end-of-turn token is appended)."""
    steps: int = 100
    """Optimiser steps."""
    batch_size: int = 64
    """Pairs per step (drawn with replacement)."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_length: int = 1024
    """Longest prompt + response in tokens; longer pairs are an error."""
    seed: int = 0
    """Seeds the draw of the pairs."""
    log_every: int = 20
    """Log the loss every this many steps."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_length", "log_every"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)


_GIVEN = "_job_keys_given"
"""Attribute of a job's worker config: the keys its section gave (None: built directly, every key counts)."""


@dataclass(kw_only=True)
class JobConfig(PPOConfig):
    """One ``ppo-core`` run: the trainer's sections plus model, reward, warm-up, backend, workers and outputs.

    Built from a mapping (:meth:`from_dict`), deprecated keys are first moved onto their canonical keys
    (:mod:`ppo_core_cli.aliases`). Once built, ``actor.worker`` and ``critic.worker`` are instances of the config
    classes of the ``workers`` kind (:mod:`ppo_core_cli.worker_kinds`), the actor's with its sampling from
    ``rollout`` and its ``use_kl_loss`` from ``actor.use_kl_loss``; the rules that relate sections are checked.
    :meth:`resolved_workers` completes the worker configs from the checkpoint and the tokenizer, and
    :meth:`ppo_config` is what the trainer receives.
    """

    data: JobDataConfig = field(default_factory=JobDataConfig)
    """Prompt files and loading (the :class:`DataConfig` fields plus files, lengths, template variables)."""
    actor: JobActorConfig = field(default_factory=JobActorConfig)
    """Actor role: ranks, KL loss and the actor worker."""
    critic: JobCriticConfig = field(default_factory=JobCriticConfig)
    """Critic role: whether it runs, ranks and the critic worker."""
    rollout: JobRolloutConfig = field(default_factory=JobRolloutConfig)
    """Responses per prompt and how they are sampled (temperature, lengths, engine...)."""
    model: JobModelConfig = field(default_factory=JobModelConfig)
    """The checkpoint the run starts from."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The rule-based reward."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The format warm-up of ``ppo-core sft``."""
    preset: str | None = None
    """Algorithm preset (``ppo``, ``grpo``, ``rloo``: :mod:`ppo_core.trainer.presets`): its keys (estimator,
    critic, where the KL goes, ``rollout.n``) are defaults that the job's own keys override; applied when the job is
    read (:func:`~ppo_core_cli.loading.load_job_config`). None: no preset."""
    backend: Backend = "local"
    """``local`` (workers in this process) or ``monarch`` (one Monarch process per rank on this host)."""
    workers: str = "torch"
    """The kind of workers (:mod:`ppo_core_cli.worker_kinds`): ``torch`` (any Hugging Face causal LM, DDP),
    ``megatron`` (Llama/Qwen2 on megatron-core; CUDA), or one you registered."""
    colocate: bool = True
    """Monarch: actor and critic share each process (one proc mesh); False: one mesh per role."""
    monarch: dict[str, Any] = field(default_factory=dict)
    """Monarch group settings (:class:`ppo_core_monarch.MonarchConfig` fields: deadlines, ``device``...), checked
    with the job where the ``monarch`` extra is installed (a mapping here because the CLI imports Monarch only
    then)."""
    run_dir: str = "runs/ppo"
    """Run directory: metrics, plot, checkpoints and export go under it (see the module docstring)."""
    export_dir: str | None = None
    """Where the final actor is exported as a Hugging Face checkpoint; None: ``{run_dir}/export``."""
    export_dtype: DType | None = None
    """Dtype of the exported weights; None: the training dtype."""
    torch_threads: int = 0
    """``torch.set_num_threads`` of this process (and its local workers); 0: leave torch's default."""
    vars: dict[str, Any] = field(default_factory=dict)
    """Your own variables for ``${vars.name}`` interpolations in the YAML (not read otherwise)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None) -> JobConfig:  # type: ignore[override]
        """Build the job from a mapping; deprecated keys are moved onto their canonical keys first (a warning
        once per key; both set and different: ``ValueError`` naming both)."""
        if data is not None and not isinstance(data, Mapping):
            return super().from_dict(data)  # its type error
        return super().from_dict(canonical_job_tree(data or {}))

    def __post_init__(self) -> None:
        check_int("torch_threads", self.torch_threads, 0)
        if self.preset is not None and self.preset not in PRESETS:
            raise FieldValueError(
                "preset", f" {self.preset!r}; valid values: {', '.join(sorted(PRESETS))}", before="unknown "
            )
        if self.workers not in worker_kind_names():
            raise FieldValueError(
                "workers",
                f" {self.workers!r}; valid values: {', '.join(worker_kind_names())}",
                before="unknown ",
            )
        self.actor = self._typed_role("actor")  # type: ignore[assignment]
        self.critic = self._typed_role("critic")  # type: ignore[assignment]
        if self.backend == "local" and (self.actor.world_size > 1 or self.critic.world_size > 1):
            raise FieldValueError(
                "actor.world_size",
                f" is {self.actor.world_size} (critic.world_size {self.critic.world_size}); the local backend "
                "runs one rank: use backend=monarch for more",
            )
        if self.backend == "monarch" and self.colocate and self.actor.world_size != self.critic.world_size:
            raise FieldValueError(
                "critic.world_size",
                f" ({self.critic.world_size}) must equal actor.world_size ({self.actor.world_size}) when the "
                "roles are colocated (colocate=true)",
            )
        super().__post_init__()  # the trainer's cross-section rules (mini-batches, estimator and critic...)
        self._check_worker_relations()
        self._check_monarch()
        self._check_resume_allow_changes()

    # ----- typed worker sections ------------------------------------------------------------------------------
    def _typed_role(self, role: str) -> JobActorConfig | JobCriticConfig:
        """The ``role`` section with its worker as the ``workers`` kind's config class: a dict is checked and
        converted once (keys the run sets are refused); the actor's sampling and KL-loss switch follow the
        canonical keys. The keys the job gave are remembered on the config (a mini-batch size left out is checked at
        run time, :meth:`check_before_run`)."""
        section = getattr(self, role)
        cls = worker_kind(self.workers).config_class(role)
        worker = section.worker
        if isinstance(worker, Mapping):
            for key in ("rollout", "use_kl_loss") if role == "actor" else ():
                if key in worker:
                    canonical = ALIASES[f"actor.worker.{key}"]
                    raise FieldValueError(
                        f"actor.worker.{key}",
                        f" is read from {canonical}; set it there (JobConfig.from_dict moves it)",
                    )
            given: frozenset[str] | None = frozenset(worker)
            if role == "actor":  # the worker's own checks (exact_log_probs...) see the job's sampling
                worker = {**worker, "rollout": self.rollout.sampling(), "use_kl_loss": self.actor.use_kl_loss}
            try:
                typed = _nested(f"{role}.worker", lambda: cls.unresolved(worker))
            except _FieldError as exc:  # a rule on the sampling: named by its key (rollout.engine...)
                if not exc.field.startswith("actor.worker.rollout."):
                    raise
                raise type(exc)(exc.field.removeprefix("actor.worker."), exc.detail, exc.before) from None
        elif isinstance(worker, cls):
            given, typed = getattr(worker, _GIVEN, None), worker
        else:
            raise FieldTypeError(
                f"{role}.worker",
                f" must be a {cls.__name__} or a dict for workers={self.workers!r}, got {type(worker).__name__}",
            )
        if role == "actor":  # raises under the canonical keys (rollout.engine...)
            typed = dataclasses.replace(
                typed, rollout=self.rollout.sampling(), use_kl_loss=self.actor.use_kl_loss
            )
        object.__setattr__(typed, _GIVEN, given)
        return dataclasses.replace(section, worker=typed)

    def _one_rollout_section(self) -> None:
        """Nothing to do: the job's actor worker took its sampling from ``rollout`` when it was typed
        (:meth:`_typed_role`)."""

    def _gives(self, role: str, key: str) -> bool:
        """Whether the job's ``role.worker`` section sets ``key`` (a worker config built directly sets all)."""
        given = getattr(getattr(self, role).worker, _GIVEN, None)
        return given is None or key in given

    def mini_batch_sizes(self) -> dict[str, int | None]:
        """``{role: ppo_mini_batch_size}`` of the roles that run, None where the job leaves it to the worker's
        default (checked before a run: :meth:`check_before_run`)."""
        sizes = self.effective_mini_batch_sizes()
        return {
            role: size if self._gives(role, "ppo_mini_batch_size") else None for role, size in sizes.items()
        }

    def effective_mini_batch_sizes(self) -> dict[str, int]:
        """``{role: ppo_mini_batch_size}`` of the roles that run, with the workers' default where the job leaves
        the key out."""
        roles = ["actor", "critic"] if self.use_critic else ["actor"]
        return {role: getattr(self, role).worker.ppo_mini_batch_size for role in roles}

    def check_before_run(self) -> None:
        """The rules a job that is built may still break only through the workers' defaults (a job built from a
        few keys is fine to inspect, not to run): checked by ``ppo-core train`` before anything loads."""
        self.check_mini_batches(dict(self.effective_mini_batch_sizes()))

    def _check_resume_allow_changes(self) -> None:
        """Each ``trainer.resume_allow_changes`` entry names a key or section of the job (or a key the run sets,
        such as ``actor.worker.hf_checkpoint``): a misspelt one would allow nothing, silently."""
        from ppo_core.trainer.resume_config import MEANING_KEYS, _under

        allowed = self.trainer.resume_allow_changes
        if not allowed:
            return
        keys: set[str] = set()

        def walk(value: Any, prefix: str) -> None:
            if prefix:
                keys.add(prefix)
            if isinstance(value, Mapping):
                for name, item in value.items():
                    walk(item, f"{prefix}.{name}" if prefix else str(name))

        walk(super().to_dict(), "")
        for entry in allowed:
            if entry not in keys and not _under(entry, MEANING_KEYS):  # a key of the job, or one the run sets
                close = difflib.get_close_matches(entry, sorted(keys), n=1, cutoff=0.8)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise FieldValueError(
                    "trainer.resume_allow_changes",
                    f" names {entry!r}, which is no key of the job{hint}: it would allow nothing",
                )

    def _run_allow_changes(self) -> tuple[str, ...]:
        """``trainer.resume_allow_changes`` as the trainer compares it: ``model.path`` (``model``) and
        ``model.critic_path`` also allow the worker keys the run sets from them (``*.worker.hf_checkpoint``)."""
        from ppo_core.trainer.resume_config import _under

        out = list(self.trainer.resume_allow_changes)
        runs = {
            "model.path": ("actor.worker.hf_checkpoint", "critic.worker.hf_checkpoint"),
            "model.critic_path": ("critic.worker.hf_checkpoint",),
        }
        for entry in list(out):
            for key, implied in runs.items():
                if _under(key, (entry,)):
                    out.extend(k for k in implied if k not in out)
        return tuple(out)

    def _check_monarch(self) -> None:
        """The ``monarch`` settings as :class:`ppo_core_monarch.MonarchConfig` checks them (errors name
        ``monarch.<key>``), whatever the backend, where the ``monarch`` extra is installed; without it a
        ``backend=monarch`` run stops where it imports Monarch."""
        if not self.monarch:
            return
        monarch_config = monarch_config_class()
        if monarch_config is not None:
            _nested("monarch", lambda: monarch_config.from_dict(self.monarch))

    def _check_half_precision_optimiser(self) -> None:
        """Workers that train in ``model.dtype`` with their Adam state in it (the torch workers): in float16 an
        ``optim.eps`` below float16's smallest normal number (6.1e-5) is refused: the default 1e-8 rounds to 0 and
        leaves Adam's denominator 0 where a gradient's second moment underflows (the first update is NaN), and a
        subnormal one is barely better (a huge step)."""
        if self.model.dtype != "float16" or not worker_kind(self.workers).optimizer_in_model_dtype:
            return
        smallest = 6.1e-5
        roles = ("actor", "critic") if self.use_critic else ("actor",)
        for role in roles:
            optim = getattr(getattr(self, role).worker, "optim", None)
            eps = getattr(optim, "eps", None)
            if isinstance(eps, float) and eps < smallest:
                raise FieldValueError(
                    "model.dtype",
                    f"=float16 trains the {self.workers} workers' float16 parameters with float16 Adam state, and "
                    f"{role}.worker.optim.eps={eps:g} is below float16's smallest normal number ({smallest:g}; the "
                    "default 1e-8 rounds to 0, and the first update is NaN); use model.dtype=bfloat16 (the same "
                    f"memory) or float32, or set {role}.worker.optim.eps >= {smallest:g}",
                )

    def _check_worker_relations(self) -> None:
        actor = self.actor.worker
        if self.use_reference and not actor.use_reference:
            need = "actor.use_kl_loss=true" if self.actor.use_kl_loss else "algorithm.use_kl_in_reward=true"
            raise FieldValueError(
                "actor.worker.use_reference",
                f"=false, but {need} needs the reference policy's log-probs (the actor worker keeps the "
                "reference)",
            )
        self._check_half_precision_optimiser()
        for role, size in self.effective_mini_batch_sizes().items():
            section = getattr(self, role)
            dp = _nested(f"{role}.worker", lambda s=section: s.worker.data_parallel_size(s.world_size))
            if size % dp:
                raise FieldValueError(
                    f"{role}.worker.ppo_mini_batch_size",
                    f"={size} must be divisible by the data-parallel size {dp} ({role}.world_size="
                    f"{section.world_size}; each data-parallel rank takes an equal share of a mini-batch)",
                )

    def resolved_workers(
        self, model_dir: str, *, eos_token_id: int | None, pad_token_id: int
    ) -> tuple[PPOActorConfig, PPOCriticConfig]:
        """The actor's and the critic's worker configs as the workers receive them: the actor's sampling with the
        run's EOS and padding ids (where ``rollout`` leaves them None), each completed from its checkpoint
        (:meth:`~ppo_core.workers.config.PPOWorkerConfig.resolved`: ``model_dir`` for the actor,
        ``model.critic_path`` or ``model_dir`` for the critic, in ``model.dtype``; the critic's value head from
        ``model.value_head_init_std`` and ``model.init_seed``)."""
        m = self.model
        sampling = self.rollout.sampling(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        actor = dataclasses.replace(self.actor.worker, rollout=sampling)
        sources = {
            role: ModelSource(
                checkpoint=path, dtype=m.dtype, value_head_init_std=m.value_head_init_std, seed=m.init_seed
            )
            for role, path in (("actor", model_dir), ("critic", m.critic_path or model_dir))
        }
        return actor.resolved(sources["actor"]), self.critic.worker.resolved(sources["critic"])

    def to_dict(self) -> dict[str, Any]:
        """The job as plain dicts that :meth:`from_dict` turns back into it: the worker sections hold the job's
        keys only (not the keys the run sets, nor the actor's ``rollout`` and ``use_kl_loss``, which are
        ``rollout`` and ``actor.use_kl_loss``, nor a ``ppo_mini_batch_size`` the job left to the default)."""
        out = super().to_dict()
        for role in ("actor", "critic"):
            keys = getattr(self, role).worker.job_keys()
            if role == "actor":
                keys.pop("rollout", None)
                keys.pop("use_kl_loss", None)
            if not self._gives(role, "ppo_mini_batch_size"):
                keys.pop("ppo_mini_batch_size", None)
            out[role]["worker"] = keys
        return out

    # ----- derived values -------------------------------------------------------------------------------------
    def _under_run_dir(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.run_dir, path)

    @property
    def checkpoint_dir(self) -> str:
        """``trainer.default_local_dir``, under ``run_dir`` when relative."""
        return self._under_run_dir(self.trainer.default_local_dir)

    @property
    def log_dir(self) -> str:
        """``trainer.log_dir`` (None: ``run_dir``), under ``run_dir`` when relative."""
        return self._under_run_dir(self.trainer.log_dir) if self.trainer.log_dir else self.run_dir

    @property
    def export_path(self) -> str:
        """``export_dir`` (None: ``{run_dir}/export``), under ``run_dir`` when relative."""
        return self._under_run_dir(self.export_dir or "export")

    def ppo_config(
        self, actor_worker: PPOActorConfig | None = None, critic_worker: PPOCriticConfig | None = None
    ) -> PPOConfig:
        """The trainer's :class:`PPOConfig`: these sections, the resolved log/checkpoint directories, and the
        worker configs (``actor_worker`` / ``critic_worker`` replace them when given: the resolved ones,
        :meth:`resolved_workers`)."""
        trainer = dataclasses.replace(
            self.trainer,
            default_local_dir=self.checkpoint_dir,
            log_dir=self.log_dir,
            resume_allow_changes=self._run_allow_changes(),
        )
        actor = ActorConfig(
            world_size=self.actor.world_size,
            use_kl_loss=self.actor.use_kl_loss,
            worker=self.actor.worker if actor_worker is None else actor_worker,
        )
        critic = CriticConfig(
            enable=self.critic.enable,
            world_size=self.critic.world_size,
            worker=self.critic.worker if critic_worker is None else critic_worker,
        )
        return PPOConfig(
            data=self.data.trainer_data(),
            actor=actor,
            critic=critic,
            rollout=self.rollout.trainer_rollout(actor.worker.rollout),
            algorithm=self.algorithm,
            trainer=trainer,
        )


def monarch_config_class() -> type[ConfigBase] | None:
    """:class:`ppo_core_monarch.MonarchConfig`, or None where the ``monarch`` extra is not installed (importing
    ``ppo_core_monarch`` first sets Monarch's supervision poll, as a Monarch run does)."""
    try:
        from ppo_core_monarch.config import MonarchConfig
    except ImportError:
        return None
    return MonarchConfig


def worker_config_classes(workers: str) -> tuple[type[PPOActorConfig], type[PPOCriticConfig]]:
    """``(actor config class, critic config class)`` of the registered worker kind ``workers``."""
    kind = worker_kind(workers)
    return kind.actor_config, kind.critic_config
