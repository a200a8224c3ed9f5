"""``PPOConfig``: the trainer's typed configuration (data, actor, critic, rollout, algorithm, trainer sections).

The sections hold what the *controller* needs, and ``rollout`` every rollout setting (``n`` and the sampling, which
the config hands to the actor worker's ``rollout``; the old ``actor.worker.rollout.<key>`` is a deprecated alias,
:mod:`~ppo_core.trainer.aliases`). Worker-specific settings (model, optimiser, mini-batch sizes) travel in each
role's ``worker``: the workers' typed config (e.g. :class:`ppo_core.workers.torch.TorchActorConfig`)
or a free-form dict of its fields, which ``init_workers()`` hands to the worker constructors. Every section round-trips with plain dicts
(``PPOConfig.from_dict(cfg.to_dict()) == cfg``), so Hydra/OmegaConf/YAML users can feed it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo_core._checks import FieldValueError, check_int
from ppo_core._config_base import ConfigBase, _nested
from ppo_core.config import AlgorithmConfig
from ppo_core.rollout.sampling import SamplingConfig
from ppo_core.trainer.aliases import canonical_tree

__all__ = [
    "GROUP_ADV_ESTIMATORS",
    "RESIDENT_ESTIMATORS",
    "ActorConfig",
    "CriticConfig",
    "DataConfig",
    "PPOConfig",
    "RolloutConfig",
    "TrainerConfig",
    "check_resident_config",
    "start_warnings",
    "worker_setting",
]

GROUP_ADV_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "grpo_passk",
    "rloo",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
)
"""Built-in advantage estimators whose baseline is the other responses to the same prompt (``rollout.n`` of them)."""

ResumeMode = Literal["auto", "disable", "path"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]


def _dotted_keys(name: str, value: object) -> tuple[str, ...]:
    # a lone string would otherwise be read as a list of one-letter keys
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of dotted config keys, got {type(value).__name__} {value!r}")
    for i, key in enumerate(value):
        if not isinstance(key, str) or not key or key.startswith(".") or key.endswith("."):
            raise ValueError(f"{name}[{i}] must be a dotted config key such as 'data.seed', got {key!r}")
    return tuple(value)


def worker_setting(worker: Mapping[str, Any] | ConfigBase, key: str) -> Any:
    """The value of ``key`` in a role's ``worker`` settings: a typed config's field or a dict's key (None when it
    has none)."""
    if isinstance(worker, Mapping):
        return worker.get(key)
    return getattr(worker, key, None)


@dataclass(kw_only=True)
class DataConfig(ConfigBase):
    """Prompt loading."""

    train_batch_size: int = 8
    """Prompts per training step (each is sampled ``rollout.n`` times); incomplete last batches are dropped."""
    val_batch_size: int | None = None
    """Prompts per validation batch; None: the whole validation set at once."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (a permutation drawn from ``seed`` and the epoch)."""
    seed: int = 0
    """Seed of the shuffling; the order depends only on (seed, epoch), so a resumed run sees the same data."""
    max_prompt_length: int | None = None
    """The prompts' length cap in tokens, for the ``prompt_length/clip_ratio`` metric (the share of prompts at the
    cap: cut to it, or exactly that long); None: that metric is not reported (a batch's padded width is its longest
    prompt, not the cap). ``ppo-core`` jobs set it from ``data.max_prompt_length``."""

    def __post_init__(self) -> None:
        check_int("train_batch_size", self.train_batch_size, 1)
        if self.val_batch_size is not None:
            check_int("val_batch_size", self.val_batch_size, 1)
        check_int("seed", self.seed, 0)  # numpy rejects negative seeds
        if self.max_prompt_length is not None:
            check_int("max_prompt_length", self.max_prompt_length, 1)


@dataclass(kw_only=True)
class ActorConfig(ConfigBase):
    """The actor/rollout role as the controller sees it."""

    world_size: int = 1
    """Ranks of the actor group (read by ``init_workers()``; also the ``n_gpus`` of throughput metrics)."""
    use_kl_loss: bool = False
    """The actor loss carries a KL term to the reference (GRPO style): the trainer computes ``ref_log_probs``.
    The worker's loss reads its own ``worker.use_kl_loss``, which must agree when given."""
    worker: dict[str, Any] | ConfigBase = field(default_factory=dict)
    """Settings for the actor worker's constructor: its typed config (e.g. a ``TorchActorConfig``) or a
    free-form dict of its fields."""

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        # The trainer must compute reference log-probs exactly when the worker's loss uses them. The flag is not
        # copied into ``worker``: custom workers' constructors need not accept it.
        given = worker_setting(self.worker, "use_kl_loss")
        if given is not None and given != self.use_kl_loss:
            raise ValueError(
                f"actor.worker.use_kl_loss={given!r} disagrees with actor.use_kl_loss={self.use_kl_loss!r}; "
                "the trainer computes reference log-probs only for actor.use_kl_loss=True"
            )


@dataclass(kw_only=True)
class CriticConfig(ConfigBase):
    """The critic role as the controller sees it."""

    enable: bool | None = None
    """Use a critic (values, critic updates); None: only when the advantage estimator is ``gae``."""
    world_size: int = 1
    """Ranks of the critic group."""
    worker: dict[str, Any] | ConfigBase = field(default_factory=dict)
    """Settings for the critic worker's constructor: its typed config or a free-form dict of its fields."""

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)


@dataclass(kw_only=True)
class RolloutConfig(SamplingConfig):
    """Every rollout setting, in one section: responses per prompt and validation sampling (what the controller
    drives) and the sampling itself (:class:`~ppo_core.rollout.sampling.SamplingConfig`: ``temperature``,
    ``max_new_tokens``, ``engine``...), which :class:`PPOConfig` hands to the actor worker as its ``rollout``."""

    n: int = 1
    """Responses sampled per training prompt (a group shares the prompt's ``uid``)."""
    val_n: int = 1
    """Responses per validation prompt."""
    val_do_sample: bool = False
    """Sample during validation; False decodes greedily (verl's default)."""
    old_log_probs_from_rollout: bool = False
    """Use the rollout engine's ``rollout_log_probs`` as ``old_log_probs`` and skip the actor's log-prob pass (one
    forward pass fewer per step; the PPO ratio then also absorbs the numerical gap between the two engines, which
    ``training/rollout_probs_diff_*`` measures while the pass runs). No ``actor/entropy`` metric then."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n", self.n, 1)
        check_int("val_n", self.val_n, 1)

    def with_sampling(self, sampling: SamplingConfig) -> RolloutConfig:
        """A copy with the sampling fields of ``sampling`` (checked when it was built: copied, not checked
        again)."""
        out = copy.copy(self)
        for f in dataclasses.fields(SamplingConfig):
            setattr(out, f.name, getattr(sampling, f.name))
        return out


@dataclass(kw_only=True)
class TrainerConfig(ConfigBase):
    """Loop length, validation and checkpoint schedule, logging, resume."""

    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: int | None = None
    """Stop after this many steps; None: ``len(train_dataloader) * total_epochs``."""
    critic_warmup: int = 0
    """Steps during which only the critic is updated (the actor update starts at step ``critic_warmup + 1``)."""
    test_freq: int = 0
    """Validate every this many steps (and after the last step); 0: only before training and at the end."""
    val_before_train: bool = True
    """Validate once before the first step."""
    log_val_generations: int = 3
    """At each validation, log this many completions as text (the first response to each of as many fixed
    prompts) and append them to ``{log_dir}/completions.jsonl`` (:mod:`ppo_core.trainer.completions`); needs the
    trainer's ``tokenizer``; 0: none."""
    save_freq: int = 0
    """Checkpoint every this many steps (and after the last step); 0 disables checkpoints."""
    default_local_dir: str = "checkpoints"
    """Checkpoint root: ``global_step_{k}/`` folders and ``latest_checkpointed_iteration.txt``."""
    resume_mode: ResumeMode = "auto"
    """``auto`` (latest checkpoint under ``default_local_dir``, if any), ``disable``, or ``path``."""
    resume_from_path: str | None = None
    """Checkpoint folder (``.../global_step_{k}``) to resume from when ``resume_mode == "path"``."""
    resume_allow_changes: tuple[str, ...] = ()
    """Dotted config keys (e.g. ``"data.train_batch_size"``) that may differ from the checkpoint's config on resume
    although they change what the run means (see :mod:`ppo_core.trainer.resume_config`); a key covers the keys
    below it."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest this many checkpoints (older ones are deleted after each save); None keeps all."""
    seed: int = 0
    """Seeds the controller's torch, numpy and python RNGs at the start of a run (restored on resume)."""
    loggers: tuple[Logger, ...] = ("console", "jsonl")
    """Metric sinks among ``console``, ``jsonl``, ``tensorboard`` and ``wandb`` (a sink whose package is missing
    is skipped with a warning). ``ppo-core train`` writes ``metrics.jsonl`` whatever this says: its summary, plot
    and timings read it."""
    log_dir: str | None = None
    """Where ``metrics.jsonl``, ``completions.jsonl`` and TensorBoard events go; None: ``default_local_dir``."""
    console_every: int = 1
    """Log to the console every this many steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar over steps (when tqdm is installed)."""
    resident_batches: bool = False
    """Keep each step's batch in the actor's workers and pass handles (``docs/resident-batches.md``): the outcome
    estimators GRPO, GRPO pass@k, RLOO, GPG and REINFORCE++-baseline, or GAE with a critic; reference log-probs and
    the KL penalty or loss; the old log-probs from the rollout (or the bypass mode); no rollout correction weights or rejection yet. False ships the batch by value on every call."""

    def __post_init__(self) -> None:
        check_int("total_epochs", self.total_epochs, 1)
        if self.total_training_steps is not None:
            check_int("total_training_steps", self.total_training_steps, 1)
        for name in ("critic_warmup", "test_freq", "save_freq", "log_val_generations"):
            check_int(name, getattr(self, name), 0)
        check_int("seed", self.seed, 0)  # numpy rejects negative seeds
        check_int("console_every", self.console_every, 1)
        if self.resume_mode == "path" and not self.resume_from_path:
            raise FieldValueError("resume_from_path", " must be set when resume_mode is 'path'")
        if self.resume_from_path and self.resume_mode != "path":
            raise FieldValueError(
                "resume_from_path",
                f"={self.resume_from_path!r} is set but resume_mode is {self.resume_mode!r}, which does not read it; "
                "set resume_mode: path to resume from it (or remove it)",
            )
        self.resume_allow_changes = _dotted_keys("trainer.resume_allow_changes", self.resume_allow_changes)
        if self.max_ckpt_to_keep is not None:
            check_int("max_ckpt_to_keep", self.max_ckpt_to_keep, 1)


@dataclass(kw_only=True)
class PPOConfig(ConfigBase):
    """Everything ``BasePPOTrainer`` reads.

    Example:
        >>> cfg = PPOConfig.from_dict({"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 4}})
        >>> cfg.rollout.n, cfg.use_critic
        (4, False)
        >>> PPOConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    data: DataConfig = field(default_factory=DataConfig)
    """Prompt loading."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Actor/rollout role."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Critic role."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and in-reward KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, validation, checkpoints, logging."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None) -> PPOConfig:  # type: ignore[override]
        """Build the config from a mapping; the deprecated ``actor.worker.rollout.<key>`` is moved onto
        ``rollout.<key>`` first (:mod:`~ppo_core.trainer.aliases`: a warning once per key; both set and different:
        ``ValueError`` naming both)."""
        if data is not None and not isinstance(data, Mapping):
            return super().from_dict(data)  # its type error
        return super().from_dict(canonical_tree(data or {}, strict=False))

    def __post_init__(self) -> None:
        self._one_rollout_section()
        # cross-section rules, checked when the config is built (before any model loads or step runs)
        alg = self.algorithm
        if alg.adv_estimator == "gae" and self.critic.enable is False:
            raise ValueError(
                "algorithm.adv_estimator='gae' needs the critic's values, but critic.enable=False; enable the "
                "critic or pick a critic-free estimator (e.g. grpo, rloo)"
            )
        if alg.adv_estimator == "grpo_passk" and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator='grpo_passk' needs groups of at least 2 responses, but rollout.n="
                f"{self.rollout.n}"
            )
        self.check_mini_batches(self.mini_batch_sizes())
        if self.trainer.resident_batches:
            check_resident_config(self)

    def _one_rollout_section(self) -> None:
        """``rollout`` holds the sampling, and the actor worker samples with it: a typed worker's ``rollout`` is
        replaced by it, a dict worker gets it as ``rollout`` where it differs from the defaults. A worker whose own
        ``rollout`` is set while the section is left at the defaults (a config built directly in the old layout)
        gives the section its sampling; both set and different is an error naming both keys. The values were
        checked when their config was built: they are handed on, not checked again."""
        worker = self.actor.worker
        own: Any = worker_setting(worker, "rollout")
        top = self.rollout.sampling_fields()
        if not isinstance(worker, Mapping) and not isinstance(own, SamplingConfig):
            return  # a custom worker config without sampling settings: nothing to hand on
        if own is not None:
            if not isinstance(own, SamplingConfig):
                own = _nested("actor.worker.rollout", lambda: SamplingConfig.from_dict(own))
            own = own.sampling_fields()
            if top == _DEFAULT_SAMPLING:  # the section takes the worker's sampling
                self.rollout = self.rollout.with_sampling(own)
                top = own
            elif own not in (_DEFAULT_SAMPLING, top):
                changed = [
                    f.name
                    for f in dataclasses.fields(SamplingConfig)
                    if getattr(own, f.name) != getattr(top, f.name)
                ]
                key = changed[0]
                raise FieldValueError(
                    f"actor.worker.rollout.{key}",
                    f"={getattr(own, key)!r} (deprecated) and rollout.{key}={getattr(top, key)!r} are both set and "
                    f"differ; keep only rollout.{key}",
                )
        if isinstance(worker, Mapping):
            rest = {k: v for k, v in worker.items() if k != "rollout"}
            worker = rest if top == _DEFAULT_SAMPLING else {**rest, "rollout": top.to_dict()}
        else:
            worker = copy.copy(worker)
            object.__setattr__(worker, "rollout", top)
        self.actor = copy.copy(self.actor)  # the caller's sections are not modified
        self.actor.worker = worker

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts that :meth:`from_dict` turns back into this config (the sampling at ``rollout`` only: the
        actor worker's ``rollout`` follows it)."""
        out = super().to_dict()
        out["actor"]["worker"].pop("rollout", None)
        return out

    def check_mini_batches(self, sizes: dict[str, int | None]) -> None:
        """Raise ``ValueError`` naming the keys when a role's ``ppo_mini_batch_size`` (``sizes[role]``; None: not
        known) does not divide the responses of a step, ``data.train_batch_size x rollout.n``."""
        rows = self.data.train_batch_size * self.rollout.n
        for role, size in sizes.items():
            if size is not None and rows % size:
                raise ValueError(
                    f"{role}.worker.ppo_mini_batch_size={size} does not divide the responses of a step, "
                    f"data.train_batch_size x rollout.n = {self.data.train_batch_size} x {self.rollout.n} = "
                    f"{rows}: each update cuts them into mini-batches of ppo_mini_batch_size responses"
                )

    def mini_batch_sizes(self) -> dict[str, int | None]:
        """``{role: ppo_mini_batch_size}`` of the roles that run (``actor``, and ``critic`` when used), as their
        workers' configs give it (None: not given; a custom worker may have no such key)."""
        roles = {"actor": self.actor.worker}
        if self.use_critic:
            roles["critic"] = self.critic.worker
        out: dict[str, int | None] = {}
        for role, worker in roles.items():
            size = worker_setting(worker, "ppo_mini_batch_size")
            out[role] = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
        return out

    @property
    def use_critic(self) -> bool:
        """Whether the critic runs: ``critic.enable``, or (when None) the estimator is ``gae``."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        """Whether reference log-probs are needed (in-reward KL or KL loss)."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss


_DEFAULT_SAMPLING = SamplingConfig()

RESIDENT_ESTIMATORS = (
    "grpo",
    "grpo_passk",
    "rloo",
    "gpg",
    "opo",
    "reinforce_plus_plus_baseline",
    "reinforce_plus_plus",
    "gae",
)
"""The advantage estimators ``trainer.resident_batches`` serves: the outcome estimators whose advantage is one
value a row (GRPO, GRPO pass@k, RLOO, GPG: computed on the controller from ``[B]`` row sums and group ids; OPO
also from the ``[B]`` row lengths), REINFORCE++-baseline (those values whitened over the tokens: the whitening's
row partials follow from the row values and lengths), and GAE and REINFORCE++ (per-row scans at the workers,
whitened from the ranks' row partials). ReMax is not served: its baseline is a greedy generation per prompt."""


def check_resident_config(config: PPOConfig) -> None:
    """``ValueError`` naming the settings when ``trainer.resident_batches`` cannot serve ``config`` yet (checked
    when the config is built, so a job is refused before any model loads)."""
    bad = []
    if config.algorithm.adv_estimator not in RESIDENT_ESTIMATORS:
        bad.append(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} (supported: {list(RESIDENT_ESTIMATORS)})"
        )
    if bad:
        raise ValueError(
            f"trainer.resident_batches=True does not support {', '.join(bad)} yet; set trainer.resident_batches=false "
            "or change those keys"
        )


def start_warnings(config: PPOConfig, *, steps_per_epoch: int) -> list[str]:
    """What a run of ``config`` would do that its keys do not say outright, one sentence each (the trainer logs
    them as warnings when it is built, before any model loads).

    - ``trainer.total_training_steps`` beyond ``total_epochs x steps_per_epoch``: the run stops earlier;
    - a group estimator (:data:`GROUP_ADV_ESTIMATORS`) with ``rollout.n = 1``: no group baseline;
    - ``trainer.critic_warmup`` covering every step: the actor is never updated.

    Args:
        config: the run's config.
        steps_per_epoch: training steps in one pass over the prompts (``len(train_dataloader)``).

    Example:
        >>> cfg = PPOConfig.from_dict({"trainer": {"total_training_steps": 10}})
        >>> start_warnings(cfg, steps_per_epoch=4)[0].split(":")[0]
        'trainer.total_training_steps=10 but trainer.total_epochs=1 x 4 steps per epoch allow 4'
    """
    out = []
    cfg = config.trainer
    available = steps_per_epoch * cfg.total_epochs
    total = available if cfg.total_training_steps is None else min(available, cfg.total_training_steps)
    if cfg.total_training_steps is not None and cfg.total_training_steps > available:
        epochs = math.ceil(cfg.total_training_steps / steps_per_epoch)
        out.append(
            f"trainer.total_training_steps={cfg.total_training_steps} but trainer.total_epochs={cfg.total_epochs} "
            f"x {steps_per_epoch} steps per epoch allow {available}: the run stops after {available} steps; set "
            f"trainer.total_epochs={epochs} to run all {cfg.total_training_steps}"
        )
    alg, n = config.algorithm, config.rollout.n
    if alg.adv_estimator in GROUP_ADV_ESTIMATORS and n == 1:
        out.append(
            f"algorithm.adv_estimator={alg.adv_estimator!r} compares the rollout.n responses to each prompt, but "
            "rollout.n=1: every group holds one response, so there is no group baseline (the advantages are the "
            "raw or batch-normalised scores); set rollout.n >= 2 (e.g. 8, the grpo preset's)"
        )
    if config.use_critic and cfg.critic_warmup >= total:
        out.append(
            f"trainer.critic_warmup={cfg.critic_warmup} covers all {total} steps: the actor is never updated"
        )
    return out
