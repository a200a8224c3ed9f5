"""``JobConfig``: everything one ``ppo-core`` run reads, as one typed config.

A job is the trainer's :class:`~ppo_core.trainer.PPOConfig` (sections ``data``, ``actor``, ``critic``, ``rollout``,
``algorithm``, ``trainer``) plus what the command needs around it: the model directory (``model``), the prompt
files (more fields in ``data``), the reward (``reward``), the format warm-up (``sft``), the backend and workers,
the run directory and the export. The worker settings (``actor.worker``, ``critic.worker``) are checked against
the chosen workers' config class (:class:`~ppo_core.workers.torch.TorchActorConfig` or
:class:`~ppo_core.workers.megatron.MegatronActorConfig`...) when the job is built, so a typo fails before any model
loads.

:func:`ppo_core_cli.loading.load_job_config` builds one from a YAML file and Hydra-style ``key=value`` overrides.
Every error names the dotted key: an unknown key lists the valid keys at that level, a value of the wrong type says
what was expected.

Paths: ``trainer.default_local_dir`` (checkpoints), ``trainer.log_dir`` (metrics; None: ``run_dir``) and
``export_dir`` are resolved under ``run_dir`` when relative; every other path is relative to the working
directory.

Example:
    >>> job = JobConfig.from_dict({"model": {"path": "m"}, "trainer": {"total_training_steps": 5}})
    >>> job.ppo_config().trainer.total_training_steps, job.checkpoint_dir
    (5, 'runs/ppo/checkpoints')
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo_core._checks import FieldValueError, check_int, check_positive
from ppo_core._config_base import ConfigBase, _nested
from ppo_core.data.prompts import TRUNCATION_POLICIES
from ppo_core.trainer.config import ActorConfig, CriticConfig, DataConfig, PPOConfig
from ppo_core.trainer.presets import PRESETS
from ppo_core.workers.megatron.hf_config import MEGATRON_SHAPE_KEYS

__all__ = [
    "INIT_SHAPES",
    "JobConfig",
    "JobDataConfig",
    "JobModelConfig",
    "RewardConfig",
    "SFTConfig",
    "ScorerConfig",
    "worker_config_classes",
]

Backend = Literal["local", "monarch"]
Workers = Literal["torch", "megatron"]
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


@dataclass(kw_only=True)
class JobConfig(PPOConfig):
    """One ``ppo-core`` run: the trainer's sections plus model, reward, warm-up, backend, workers and outputs.

    :meth:`ppo_config` is what the trainer receives. The worker dicts are checked here against the workers'
    config classes; the command completes them (EOS and padding ids from the tokenizer, the megatron model shape
    from ``model.path``) before the workers are built.
    """

    data: JobDataConfig = field(default_factory=JobDataConfig)
    """Prompt files and loading (the :class:`DataConfig` fields plus files, lengths, template variables)."""
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
    workers: Workers = "torch"
    """``torch`` (any Hugging Face causal LM, DDP) or ``megatron`` (Llama/Qwen2 on megatron-core; CUDA)."""
    colocate: bool = True
    """Monarch: actor and critic share each process (one proc mesh); False: one mesh per role."""
    monarch: dict[str, Any] = field(default_factory=dict)
    """Monarch group settings (:class:`ppo_core_monarch.MonarchConfig` fields: deadlines, ``device``...)."""
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

    def __post_init__(self) -> None:
        check_int("torch_threads", self.torch_threads, 0)
        if self.preset is not None and self.preset not in PRESETS:
            raise FieldValueError(
                "preset", f" {self.preset!r}; valid values: {', '.join(sorted(PRESETS))}", before="unknown "
            )
        actor_cls, critic_cls = worker_config_classes(self.workers)
        for role, cls in (("actor", actor_cls), ("critic", critic_cls)):
            worker = getattr(self, role).worker
            _check_cli_owned(role, worker, self.workers)
            _nested(
                f"{role}.worker",
                lambda cls=cls, worker=worker: cls.from_dict(_checkable(worker, self.workers)),
            )
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

    def _worker_configs(self) -> dict[str, ConfigBase]:
        actor_cls, critic_cls = worker_config_classes(self.workers)
        return {
            "actor": actor_cls.from_dict(_checkable(self.actor.worker, self.workers)),
            "critic": critic_cls.from_dict(_checkable(self.critic.worker, self.workers)),
        }

    def effective_mini_batch_sizes(self) -> dict[str, int]:
        """``{role: ppo_mini_batch_size}`` of the roles that run, with the workers' default where the job leaves
        the key out."""
        configs = self._worker_configs()
        roles = ["actor", "critic"] if self.use_critic else ["actor"]
        return {role: configs[role].ppo_mini_batch_size for role in roles}  # type: ignore[attr-defined]

    def check_before_run(self) -> None:
        """The rules a job that is built may still break only through the workers' defaults (a job built from a
        few keys is fine to inspect, not to run): checked by ``ppo-core train`` before anything loads."""
        self.check_mini_batches(dict(self.effective_mini_batch_sizes()))

    def _check_worker_relations(self) -> None:
        configs = self._worker_configs()
        actor = configs["actor"]
        if self.use_reference and not actor.use_reference:  # type: ignore[attr-defined]
            need = "actor.use_kl_loss=true" if self.actor.use_kl_loss else "algorithm.use_kl_in_reward=true"
            raise FieldValueError(
                "actor.worker.use_reference",
                f"=false, but {need} needs the reference policy's log-probs (the actor worker keeps the "
                "reference)",
            )
        engine = actor.rollout.engine  # type: ignore[attr-defined]
        if engine == "megatron" and self.workers != "megatron":
            raise FieldValueError(
                "actor.worker.rollout.engine",
                f"='megatron' samples with the megatron actor's policy: it needs workers: megatron (workers is "
                f"{self.workers!r}; use auto, hf or reference with it)",
            )
        if self.workers == "torch":  # one data-parallel rank per process
            for role, size in self.effective_mini_batch_sizes().items():
                dp = getattr(self, role).world_size
                if size % dp:
                    raise FieldValueError(
                        f"{role}.worker.ppo_mini_batch_size",
                        f"={size} must be divisible by {role}.world_size={dp} (each data-parallel rank takes "
                        "an equal share of a mini-batch)",
                    )

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
        self, actor_worker: Mapping[str, Any] | None = None, critic_worker: Mapping[str, Any] | None = None
    ) -> PPOConfig:
        """The trainer's :class:`PPOConfig`: these sections, the resolved log/checkpoint directories, and the
        worker dicts (``actor_worker`` / ``critic_worker`` replace them when given: the completed ones); the actor's
        gets ``use_kl_loss`` from ``actor.use_kl_loss`` when it does not set it."""
        trainer = dataclasses.replace(
            self.trainer, default_local_dir=self.checkpoint_dir, log_dir=self.log_dir
        )
        # the command's workers take the KL-loss switch too: actor.use_kl_loss alone turns the loss term on
        worker = {
            "use_kl_loss": self.actor.use_kl_loss,
            **(self.actor.worker if actor_worker is None else actor_worker),
        }
        actor = ActorConfig(
            world_size=self.actor.world_size, use_kl_loss=self.actor.use_kl_loss, worker=worker
        )
        critic = CriticConfig(
            enable=self.critic.enable,
            world_size=self.critic.world_size,
            worker=dict(self.critic.worker if critic_worker is None else critic_worker),
        )
        return PPOConfig(
            data=self.data.trainer_data(),
            actor=actor,
            critic=critic,
            rollout=self.rollout,
            algorithm=self.algorithm,
            trainer=trainer,
        )


_CLI_OWNED = {
    "torch": (),
    "megatron": ("hf_checkpoint", "model.dtype", *(f"model.{key}" for key in MEGATRON_SHAPE_KEYS)),
}
"""Worker keys the command sets itself (from ``model.path`` and ``model.dtype``): a job may not set them."""

# a valid megatron shape, to check the other worker keys before the checkpoint's shape is read
_STAND_IN_SHAPE = {
    "num_layers": 1,
    "hidden_size": 8,
    "num_attention_heads": 1,
    "ffn_hidden_size": 8,
    "vocab_size": 8,
}


def _check_cli_owned(role: str, worker: Mapping[str, Any], workers: str) -> None:
    model = worker.get("model")
    for key in _CLI_OWNED[workers]:
        head, _, tail = key.partition(".")
        given = head in worker if not tail else isinstance(model, Mapping) and tail in model
        if given:
            source = "model.dtype" if key == "model.dtype" else "model.path's config.json"
            raise FieldValueError(
                f"{role}.worker.{key}", f" is set by the command from {source}; remove it from the job"
            )


def _checkable(worker: Mapping[str, Any], workers: str) -> dict[str, Any]:
    """The worker dict as its config class can check it: megatron's model shape comes from the checkpoint, so
    a stand-in shape fills the keys the job may not set."""
    out = dict(worker)
    model = out.get("model", {})
    if workers == "megatron" and isinstance(
        model, Mapping
    ):  # a model that is no mapping: its type error shows
        out["model"] = {**_STAND_IN_SHAPE, **model}
    return out


def worker_config_classes(workers: str) -> tuple[type[ConfigBase], type[ConfigBase]]:
    """``(actor config class, critic config class)`` of ``workers`` (``torch`` or ``megatron``)."""
    if workers == "torch":
        from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

        return TorchActorConfig, TorchCriticConfig
    if workers == "megatron":
        from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig

        return MegatronActorConfig, MegatronCriticConfig
    raise ValueError(f"unknown workers {workers!r}; valid values: megatron, torch")
