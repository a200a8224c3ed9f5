"""The tables behind :func:`ppo_core.compat.convert_verl`: every verl config key it reads, refuses, drops or passes.

Each :class:`Rule` names one verl key (dotted, as in verl's ``ppo_trainer.yaml``), verl's value when the key is
absent, the ppo-core paths it sets and how the value changes on the way. A rule without targets only constrains
(a feature ppo-core does not have is accepted only when it is switched off) or feeds another rule. The other keys
of verl's config (:data:`ppo_core.compat._verl_defaults.DEFAULTS`) pass quietly at verl's default; set to anything
else, a key in :data:`REFUSED` (the switch of a feature ppo-core lacks) is refused with the reason, a key in
:data:`IGNORED` (engine, memory and speed knobs, logging, keys read only with a feature that is off) is dropped and
listed with the reason, and any other key is refused. :data:`STRUCTURAL` keys (Hydra's and verl's machinery) pass
whatever their value.

Abbreviations in the keys: ``A`` = ``actor_rollout_ref.actor``, ``R`` = ``actor_rollout_ref.rollout``,
``F`` = ``actor_rollout_ref.ref``, ``M`` = ``actor_rollout_ref.model``, ``C`` = ``critic``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "IGNORED",
    "JOB_PATHS",
    "REFUSED",
    "ROLLOUT_CORRECTION_RULES",
    "RULES",
    "SKIP",
    "STRUCTURAL",
    "Emit",
    "Ref",
    "Rule",
    "Unsupported",
]

logger = logging.getLogger("ppo_core.compat.verl")

A, R, F, M, C = (
    "actor_rollout_ref.actor",
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.ref",
    "actor_rollout_ref.model",
    "critic",
)


class Unsupported(Exception):
    """Raised by a rule's ``convert`` when the value asks for something ppo-core does not do; ``key``: the verl key
    at fault where it is another key than the rule's own (a value the rule reads), so that the error names it."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Ref:
    """verl's default is the value of another key (an interpolation in verl's YAML)."""

    key: str


@dataclass(frozen=True)
class Emit:
    """A ``convert`` result that sets several ppo-core paths to different values."""

    values: dict[str, Any]


class Reader(Protocol):
    """What a rule's ``convert`` may ask about the rest of the verl config."""

    def __call__(self, key: str) -> Any: ...  # the effective value (given, or verl's default)

    def given(self, key: str) -> bool: ...  # whether the user's config sets the key


SKIP = object()
"""A ``convert`` result meaning: set nothing (ppo-core's default applies)."""


def _same(value: Any, get: Reader) -> Any:
    return value


@dataclass(frozen=True)
class Rule:
    """How one verl key becomes ppo-core settings."""

    key: str
    """verl's dotted key."""
    default: Any
    """verl's value when the key is absent (a :class:`Ref` for verl's interpolations)."""
    targets: tuple[str, ...] = ()
    """ppo-core dotted paths set to the converted value (none: the rule only constrains or feeds another)."""
    convert: Callable[[Any, Reader], Any] = _same
    """verl value -> ppo-core value; raises :class:`Unsupported`, returns ``SKIP`` or an :class:`Emit`."""
    doc: str = ""
    """How the value changes, for the migration guide (empty: copied as is)."""


def _only(*allowed: Any, reason: str) -> Callable[[Any, Reader], Any]:
    """A feature ppo-core does not have: accepted only with a value that switches it off."""

    def convert(value: Any, get: Reader) -> Any:
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise Unsupported(reason)
        return SKIP

    convert.allowed, convert.reason = allowed, reason  # type: ignore[attr-defined]  # (for the guide's table)
    convert.skip_means = "quiet"  # type: ignore[attr-defined]  # (an accepted value: nothing to report)
    return convert


def _bypass_loss_type(value: Any, get: Reader) -> Any:
    """verl reads ``rollout_correction.loss_type`` in the bypass mode only."""
    return value if get("algorithm.rollout_correction.bypass_mode") is True else SKIP


def _rollout_correction_on(get: Reader) -> bool:
    """Whether verl's rollout correction reads the rollout's log-probs (weights, rejection or the bypass mode)."""
    section = "algorithm.rollout_correction"
    return (
        get(f"{section}.rollout_is") is not None
        or get(f"{section}.rollout_rs") is not None
        or get(f"{section}.bypass_mode") is True
    )


def _logprobs_mode(value: Any, get: Reader) -> Any:
    """verl's rollout log-probs of another kind than ppo-core's: refused only where the rollout correction reads
    them (dropped otherwise)."""
    if value != "processed_logprobs" and _rollout_correction_on(get):
        raise Unsupported(
            "ppo-core's rollout log-probs are log_softmax(logits / temperature) at the drawn token (verl's "
            "processed_logprobs), which algorithm.rollout_correction compares with the old log-probs"
        )
    return SKIP


def _int(value: Any, key: str) -> int:
    """``value`` if it is an int; :class:`Unsupported` naming ``key`` otherwise (it is used in arithmetic). A
    ``key`` that is a verl key (dotted) is the error's :attr:`Unsupported.key`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Unsupported(
            f"{key} must be an int, got {type(value).__name__} {value!r}", key=key if "." in key else None
        )
    return value


def _world_size(get: Reader) -> int:
    return _int(get("trainer.nnodes"), "trainer.nnodes") * _int(
        get("trainer.n_gpus_per_node"), "trainer.n_gpus_per_node"
    )


def _times_n(value: Any, get: Reader) -> Any:
    return _int(value, "the mini-batch size") * _int(get(f"{R}.n"), f"{R}.n")


def _per_gpu(global_key: str) -> Callable[[Any, Reader], Any]:
    """verl's ``*_per_gpu`` size, or its deprecated global size divided by the world size (which wins if set)."""

    def convert(value: Any, get: Reader) -> Any:
        total = get(global_key)
        if total is None:
            return value
        total, world = _int(total, global_key), _world_size(get)
        if total % world:
            raise Unsupported(f"{global_key}={total} is not divisible by the {world} GPUs of the run")
        return total // world

    return convert


def _grad_clip(section: str) -> Callable[[Any, Reader], Any]:
    """verl reads ``<section>.grad_clip`` (legacy workers) or ``<section>.optim.clip_grad`` (new engine)."""

    def convert(value: Any, get: Reader) -> Any:
        other = f"{section}.optim.clip_grad"
        if get.given(other) and get.given(f"{section}.grad_clip") and get(other) != value:
            raise Unsupported(f"disagrees with {other}={get(other)!r}; set one of them")
        return get(other) if get.given(other) else value

    return convert


def _scale_factor(agg_key: str) -> Callable[[Any, Reader], Any]:
    """verl divides ``seq-mean-token-sum-norm`` by the padded response length when no factor is set."""

    def convert(value: Any, get: Reader) -> Any:
        if value is None and get(agg_key) == "seq-mean-token-sum-norm":
            return get(f"{R}.response_length")
        return value

    return convert


def _use_kl_loss(value: Any, get: Reader) -> Any:
    return Emit(
        {
            "actor.use_kl_loss": value,
            "actor.worker.use_kl_loss": value,
            "actor.worker.use_reference": bool(value) or bool(get("algorithm.use_kl_in_reward")),
        }
    )


def _disabled_as_zero(value: Any, get: Reader) -> Any:
    return 0 if value is not None and _int(value, "the frequency") <= 0 else value


def _resume_mode(value: Any, get: Reader) -> Any:
    modes = {"auto": "auto", "disable": "disable", "resume_path": "path"}
    if value not in modes:
        raise Unsupported(f"valid values: {', '.join(modes)}")
    return modes[value]


def _resume_from_path(value: Any, get: Reader) -> Any:
    # verl reads it only with resume_mode: resume_path; ppo-core refuses a path its mode would not read
    if value is not None and get("trainer.resume_mode") != "resume_path":
        logger.warning(
            "trainer.resume_from_path %r: dropped, verl reads it only with resume_mode: resume_path (the config's "
            "resume_mode is %r)",
            value,
            get("trainer.resume_mode"),
        )
        return SKIP
    return value


def _loggers(value: Any, get: Reader) -> Any:
    # Other remote trackers (swanlab, mlflow...) become metrics.jsonl: the metrics are still recorded, locally.
    kept = ("console", "tensorboard", "wandb")
    names = [value] if isinstance(value, str) else list(value or [])
    out = [name if name in kept else "jsonl" for name in names]
    dropped = [name for name in names if name not in kept]
    if dropped:
        logger.warning(
            "trainer.logger %s: not available in ppo-core, metrics go to metrics.jsonl instead", dropped
        )
    return tuple(dict.fromkeys(out)) or ("console",)


def _default_local_dir(value: Any, get: Reader) -> Any:
    if not get.given("trainer.default_local_dir"):
        return f"checkpoints/{get('trainer.project_name')}/{get('trainer.experiment_name')}"
    return value


def _registry_name(kind: str, names: Callable[[], Any]) -> Callable[[Any, Reader], Any]:
    def convert(value: Any, get: Reader) -> Any:
        valid = list(names())
        if value not in valid:
            raise Unsupported(f"not a ppo-core {kind}; ppo-core has: {', '.join(sorted(valid))}")
        return value

    convert.kind = kind  # type: ignore[attr-defined]  # (for the guide's table)
    return convert


def _adv_estimators() -> Any:
    from ppo_core.advantages import advantage_estimator_names

    return advantage_estimator_names()


def _policy_losses() -> Any:
    from ppo_core.losses import policy_loss_names

    return policy_loss_names()


def _loss_agg_modes() -> Any:
    from ppo_core.losses import LOSS_AGG_MODES

    return LOSS_AGG_MODES


def _kl_estimators() -> Any:
    from ppo_core.kl import KL_ESTIMATORS

    return KL_ESTIMATORS


def _in_reward_kl_estimators() -> Any:
    from ppo_core.config import IN_REWARD_KL_ESTIMATORS

    return IN_REWARD_KL_ESTIMATORS


def _strategy(value: Any, get: Reader) -> Any:
    if value not in ("fsdp", "fsdp2", "megatron"):
        raise Unsupported("valid values: fsdp, fsdp2 (ppo-core's torch workers), megatron")
    return SKIP


_strategy.skip_means = "mapped"  # type: ignore[attr-defined]  # (it picks the workers)


def _if_megatron(strategy_key: str) -> Callable[[Any, Reader], Any]:
    def convert(value: Any, get: Reader) -> Any:
        return value if get(strategy_key) == "megatron" else SKIP

    return convert


def _val_sampling(train_key: str) -> Callable[[Any, Reader], Any]:
    """ppo-core samples validation responses with the training temperature / top-p (greedy unless do_sample)."""

    def convert(value: Any, get: Reader) -> Any:
        if get(f"{R}.val_kwargs.do_sample") and value != get(train_key):
            raise Unsupported(f"ppo-core samples validation responses with {train_key}={get(train_key)!r}")
        return SKIP

    return convert


_NO_DYNAMIC_BSZ = (
    "the token-budget keys are not translated yet; set ppo-core's ppo_max_token_len_per_gpu / "
    "forward_max_token_len_per_gpu, or the *_micro_batch_size_per_gpu sizes"
)
_NO_SP = "Ulysses sequence parallelism is not implemented"
_CONSTANT_LR = "learning-rate schedules are not implemented (ppo-core's optimiser keeps lr constant)"
_NO_LORA = "LoRA is not implemented"
_NO_REWARD_MODEL = "model-based rewards: compute them in your reward function"
_NO_SANDBOX = "code-execution rewards (sandbox fusion) are not implemented"
_CUSTOM_REWARD = (
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info) is not called by ppo-core: "
    "register it as a scorer (`reward.scorers.<data_source>.function: module:function`, called as "
    "function(solution_str, ground_truth, extra_info)) in the converted job"
)

ROLLOUT_CORRECTION_RULES: tuple[Rule, ...] = (
    *(
        Rule(f"algorithm.rollout_correction.{name}", default, (f"algorithm.rollout_correction.{name}",))
        for name, default in (
            ("rollout_is", None),
            ("rollout_is_threshold", 2.0),
            ("rollout_is_batch_normalize", False),
            ("rollout_rs", None),
            ("rollout_rs_threshold", None),
        )
    ),
    Rule(
        "algorithm.rollout_correction.bypass_mode",
        False,
        ("algorithm.rollout_correction.bypass_mode",),
        doc='copied; with `rollout_is` and `rollout_rs` null only (docs/semantics.md, "Rollout correction")',
    ),
    Rule(
        "algorithm.rollout_correction.loss_type",
        "ppo_clip",
        ("algorithm.rollout_correction.loss_type",),
        _bypass_loss_type,
        doc="copied with `bypass_mode` (only ppo_clip); ignored without it, as in verl",
    ),
)
"""verl's ``algorithm.rollout_correction`` section, one to one to ppo-core's ``algorithm.rollout_correction``
(:class:`~ppo_core.rollout_correction.RolloutCorrectionConfig`, same names and meanings). ``loss_type`` is read in
the bypass mode only, as verl does; what ppo-core's config refuses (the bypass mode with ``rollout_is`` or
``rollout_rs``, a ``loss_type`` other than ``ppo_clip``) is refused naming the verl key."""


def _optim_rules(section: str, lr: float, target: str) -> list[Rule]:
    return [
        Rule(f"{section}.optim.lr", lr, (f"{target}.optim.lr",)),
        Rule(f"{section}.optim.betas", [0.9, 0.999], (f"{target}.optim.betas",)),
        Rule(f"{section}.optim.weight_decay", 0.01, (f"{target}.optim.weight_decay",)),
        Rule(f"{section}.optim.eps", 1e-8, (f"{target}.optim.eps",)),
        Rule(f"{section}.optim.clip_grad", 1.0, doc=f"read with `{section}.grad_clip`"),
        Rule(
            f"{section}.grad_clip",
            1.0,
            (f"{target}.optim.grad_clip",),
            _grad_clip(section),
            "or `optim.clip_grad` when that is given (both given: they must agree)",
        ),
        Rule(
            f"{section}.optim.optimizer",
            "AdamW",
            convert=_only("AdamW", "adamw", "adam", reason="ppo-core's workers use AdamW"),
        ),
        Rule(
            f"{section}.optim.optimizer_impl",
            "torch.optim",
            convert=_only("torch.optim", reason="ppo-core's workers use torch.optim.AdamW"),
        ),
        Rule(f"{section}.optim.lr_warmup_steps_ratio", 0.0, convert=_only(0.0, 0, reason=_CONSTANT_LR)),
        Rule(f"{section}.optim.lr_warmup_steps", -1, convert=_only(-1, 0, None, reason=_CONSTANT_LR)),
        Rule(
            f"{section}.optim.lr_scheduler_type", "constant", convert=_only("constant", reason=_CONSTANT_LR)
        ),
        Rule(f"{section}.optim.warmup_style", None, convert=_only(None, "constant", reason=_CONSTANT_LR)),
        Rule(f"{section}.optim.lr_decay_style", "constant", convert=_only("constant", reason=_CONSTANT_LR)),
        Rule(
            f"{section}.optim.weight_decay_incr_style",
            "constant",
            convert=_only("constant", reason="weight-decay schedules are not implemented"),
        ),
        Rule(
            f"{section}.optim.override_optimizer_config",
            None,
            convert=_only(None, {}, reason="optimizer overrides are not supported"),
        ),
    ]


def _batch_rules(section: str, target: str, *, critic: bool) -> list[Rule]:
    mini_default: Any = Ref(f"{A}.ppo_mini_batch_size") if critic else 256
    rules = [
        Rule(
            f"{section}.ppo_mini_batch_size",
            mini_default,
            (f"{target}.ppo_mini_batch_size",),
            _times_n,
            "x `rollout.n`: verl counts prompts, ppo-core counts responses",
        ),
        Rule(f"{section}.ppo_micro_batch_size", None, doc="divided by the GPUs (nnodes x n_gpus_per_node)"),
        Rule(
            f"{section}.ppo_micro_batch_size_per_gpu",
            None,
            (f"{target}.micro_batch_size",),
            _per_gpu(f"{section}.ppo_micro_batch_size"),
            "or the deprecated global `ppo_micro_batch_size` / GPUs; None: the whole local mini-batch",
        ),
        Rule(
            f"{section}.use_dynamic_bsz",
            Ref(f"{A}.use_dynamic_bsz") if critic else False,
            convert=_only(False, reason=_NO_DYNAMIC_BSZ),
        ),
        Rule(
            f"{section}.ppo_epochs",
            Ref(f"{A}.ppo_epochs") if critic else 1,
            (f"{target}.ppo_epochs",),
        ),
        Rule(f"{section}.shuffle", Ref(f"{A}.shuffle") if critic else False, (f"{target}.shuffle",)),
        Rule(f"{section}.data_loader_seed", 42, (f"{target}.seed",), doc="seeds the worker's generator"),
        Rule(f"{section}.ulysses_sequence_parallel_size", 1, convert=_only(1, reason=_NO_SP)),
        Rule(f"{section}.strategy", Ref(f"{A}.strategy") if critic else "fsdp", convert=_strategy),
    ]
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        rules.append(
            Rule(
                f"{section}.megatron.{name}",
                1,
                (f"{target}.parallel.{name}",),
                _if_megatron(f"{section}.strategy"),
                "megatron strategy only",
            )
        )
    rules += [
        Rule(
            f"{section}.megatron.sequence_parallel",
            True,
            (f"{target}.parallel.sequence_parallel",),
            _if_megatron(f"{section}.strategy"),
            "megatron strategy only",
        ),
        Rule(
            f"{section}.megatron.use_distributed_optimizer",
            True,
            (f"{target}.use_distributed_optimizer",),
            _if_megatron(f"{section}.strategy"),
            "megatron strategy only",
        ),
        Rule(
            f"{section}.megatron.virtual_pipeline_model_parallel_size",
            None,
            convert=_only(None, 1, reason="interleaved (virtual) pipeline stages are not implemented"),
        ),
        Rule(
            f"{section}.megatron.expert_model_parallel_size",
            1,
            convert=_only(1, reason="mixture-of-experts models are not implemented"),
        ),
        Rule(
            f"{section}.megatron.expert_tensor_parallel_size",
            None,
            convert=_only(None, 1, reason="mixture-of-experts models are not implemented"),
        ),
        Rule(
            f"{section}.megatron.override_mcore_model_config",
            {},
            convert=_only(
                {}, None, reason="model overrides are not supported; set the worker's `model` shape"
            ),
        ),
    ]
    return rules


def _files(value: Any, get: Reader) -> Any:
    """verl's file key (a path or a list of paths) as a list, ``~`` expanded."""
    names = [value] if isinstance(value, str) else list(value or [])
    return [os.path.expanduser(str(name)) for name in names]


def _optional_path(value: Any, get: Reader) -> Any:
    return SKIP if value is None else os.path.expanduser(str(value))


def _truncation(value: Any, get: Reader) -> Any:
    if get("data.filter_overlong_prompts"):
        return "filter"  # verl drops the longer prompts before training; truncation never applies
    if value not in ("error", "left", "right"):
        raise Unsupported("valid values: error, left, right (ppo-core has no `middle` truncation)")
    return value


_PLACEHOLDER_MODEL = "~/models/deepseek-llm-7b-chat"
"""verl's default model path: a placeholder every launch script overrides."""


def _model_path(job_target: str, strategy_key: str) -> Callable[[Any, Reader], Any]:
    """The checkpoint: the job's model section; also the megatron worker's ``hf_checkpoint`` (library use)."""

    def convert(value: Any, get: Reader) -> Any:
        path = os.path.expanduser(str(value))
        if job_target == "model.critic_path" and (
            value == _PLACEHOLDER_MODEL or path == os.path.expanduser(str(get(f"{M}.path")))
        ):
            return SKIP  # the critic starts from the actor's checkpoint: ppo-core's default
        out = {job_target: path}
        if get(strategy_key) == "megatron":
            out[f"{'actor' if job_target == 'model.path' else 'critic'}.worker.hf_checkpoint"] = path
        return Emit(out)

    convert.skip_means = "mapped"  # type: ignore[attr-defined]  # (the critic starts from the actor's checkpoint)
    return convert


def _model_rules(section: str, target: str, strategy_key: str) -> list[Rule]:
    job_target = "model.path" if target == "actor.worker" else "model.critic_path"
    return [
        Rule(
            f"{section}.path",
            _PLACEHOLDER_MODEL,
            (job_target, f"{target}.hf_checkpoint"),
            _model_path(job_target, strategy_key),
            "`~` expanded; also the megatron worker's `hf_checkpoint` (ppo-core loads local checkpoints only)"
            + ("; left out when it is the actor's or verl's placeholder" if target != "actor.worker" else ""),
        ),
        Rule(f"{section}.lora_rank", 0, convert=_only(0, reason=_NO_LORA)),
        Rule(f"{section}.lora.rank", 0, convert=_only(0, reason=_NO_LORA)),
        Rule(
            f"{section}.override_config.model_config",
            {},
            convert=_only({}, None, reason="model config overrides are not supported"),
        ),
        Rule(
            f"{section}.override_config.moe_config.freeze_moe_router",
            False,
            convert=_only(False, reason="mixture-of-experts models are not implemented"),
        ),
    ]


RULES: tuple[Rule, ...] = (
    # ----- data
    Rule("data.train_batch_size", 1024, ("data.train_batch_size",)),
    Rule("data.val_batch_size", None, ("data.val_batch_size",)),
    Rule("data.shuffle", True, ("data.shuffle",)),
    Rule(
        "data.seed",
        None,
        ("data.seed",),
        lambda v, get: SKIP if v is None else v,
        "None: ppo-core's default 0 (the shuffled order differs from verl's in any case)",
    ),
    Rule("data.max_response_length", 512, doc="the default of `rollout.response_length`"),
    Rule(
        "data.validation_shuffle", False, convert=_only(False, reason="validation prompts are not shuffled")
    ),
    Rule(
        "data.sampler.class_path",
        None,
        convert=_only(
            None, reason="custom samplers (curricula) are not supported; the loader shuffles per epoch"
        ),
    ),
    Rule("data.datagen.path", None, convert=_only(None, reason="dynamic data generation is not supported")),
    # ----- data: the job's prompt files
    Rule(
        "data.train_files",
        "~/data/rlhf/gsm8k/train.parquet",
        ("data.train_files",),
        _files,
        "a list; `~` expanded",
    ),
    Rule(
        "data.val_files",
        "~/data/rlhf/gsm8k/test.parquet",
        ("data.val_files",),
        _files,
        "a list; `~` expanded",
    ),
    Rule("data.max_prompt_length", 512, ("data.max_prompt_length",)),
    Rule("data.prompt_key", "prompt", ("data.prompt_key",)),
    Rule(
        "data.truncation",
        "error",
        ("data.truncation",),
        _truncation,
        "`filter` when `filter_overlong_prompts` is true; `middle` is refused",
    ),
    Rule("data.filter_overlong_prompts", False, doc="true: `data.truncation: filter`"),
    Rule("data.apply_chat_template_kwargs", {}, ("data.chat_template_kwargs",)),
    Rule(
        "data.train_max_samples",
        -1,
        convert=_only(-1, None, reason="ppo-core reads every prompt of the files: shorten the files instead"),
    ),
    Rule(
        "data.val_max_samples",
        -1,
        convert=_only(-1, None, reason="ppo-core reads every prompt of the files: shorten the files instead"),
    ),
    Rule(
        "data.reward_fn_key",
        "data_source",
        convert=_only("data_source", reason="ppo-core picks the scorer by the `data_source` column"),
    ),
    Rule(
        "data.custom_cls.path",
        None,
        convert=_only(None, reason="custom dataset classes are not supported (ppo-core reads verl's schema)"),
    ),
    # ----- algorithm
    Rule(
        "algorithm.adv_estimator",
        "gae",
        ("algorithm.adv_estimator",),
        _registry_name("advantage estimator", _adv_estimators),
    ),
    Rule("algorithm.gamma", 1.0, ("algorithm.gamma",)),
    Rule("algorithm.lam", 1.0, ("algorithm.lam",)),
    Rule("algorithm.norm_adv_by_std_in_grpo", True, ("algorithm.norm_adv_by_std_in_grpo",)),
    Rule("algorithm.use_kl_in_reward", False, ("algorithm.use_kl_in_reward",)),
    Rule(
        "algorithm.kl_penalty",
        "kl",
        ("algorithm.kl_penalty",),
        _registry_name("in-reward KL estimator", _in_reward_kl_estimators),
    ),
    Rule("algorithm.kl_ctrl.type", "fixed", ("algorithm.kl_ctrl.type",)),
    Rule("algorithm.kl_ctrl.kl_coef", 0.001, ("algorithm.kl_ctrl.kl_coef",)),
    Rule("algorithm.kl_ctrl.horizon", 10000, ("algorithm.kl_ctrl.horizon",)),
    Rule("algorithm.kl_ctrl.target_kl", 0.1, ("algorithm.kl_ctrl.target_kl",)),
    Rule("algorithm.use_pf_ppo", False, convert=_only(False, reason="PF-PPO reweighting is not implemented")),
    *ROLLOUT_CORRECTION_RULES,
    # ----- actor: loss
    Rule(f"{A}.clip_ratio", 0.2, ("actor.worker.policy_loss.clip_ratio",)),
    Rule(
        f"{A}.clip_ratio_low",
        0.2,
        ("actor.worker.policy_loss.clip_ratio_low",),
        doc="null: `clip_ratio` (as in verl)",
    ),
    Rule(
        f"{A}.clip_ratio_high",
        0.2,
        ("actor.worker.policy_loss.clip_ratio_high",),
        doc="null: `clip_ratio` (as in verl)",
    ),
    Rule(f"{A}.clip_ratio_c", 3.0, ("actor.worker.policy_loss.clip_ratio_c",)),
    Rule(f"{A}.tau_pos", 1.0, ("actor.worker.policy_loss.tau_pos",)),
    Rule(f"{A}.tau_neg", 1.05, ("actor.worker.policy_loss.tau_neg",)),
    Rule(
        f"{A}.policy_loss.loss_mode",
        "vanilla",
        ("actor.worker.policy_loss.loss_mode",),
        _registry_name("policy loss", _policy_losses),
    ),
    Rule(f"{A}.policy_loss.clip_cov_ratio", 0.0002, ("actor.worker.policy_loss.clip_cov_ratio",)),
    Rule(f"{A}.policy_loss.clip_cov_lb", 1.0, ("actor.worker.policy_loss.clip_cov_lb",)),
    Rule(f"{A}.policy_loss.clip_cov_ub", 5.0, ("actor.worker.policy_loss.clip_cov_ub",)),
    Rule(f"{A}.policy_loss.kl_cov_ratio", 0.0002, ("actor.worker.policy_loss.kl_cov_ratio",)),
    Rule(f"{A}.policy_loss.ppo_kl_coef", 0.1, ("actor.worker.policy_loss.ppo_kl_coef",)),
    Rule(
        f"{A}.loss_agg_mode",
        "token-mean",
        ("actor.worker.policy_loss.loss_agg_mode",),
        _registry_name("loss_agg_mode", _loss_agg_modes),
    ),
    Rule(
        f"{A}.loss_scale_factor",
        None,
        ("actor.worker.loss_scale_factor",),
        _scale_factor(f"{A}.loss_agg_mode"),
        "None with `seq-mean-token-sum-norm`: `rollout.response_length` (verl's padded width)",
    ),
    Rule(f"{A}.entropy_coeff", 0.0, ("actor.worker.entropy_coeff",)),
    Rule(
        f"{A}.use_kl_loss",
        False,
        ("actor.use_kl_loss", "actor.worker.use_kl_loss", "actor.worker.use_reference"),
        _use_kl_loss,
        "also `actor.worker.use_reference` = `use_kl_loss` or `algorithm.use_kl_in_reward` (verl builds the "
        "reference model only then)",
    ),
    Rule(f"{A}.kl_loss_coef", 0.001, ("actor.worker.kl_loss_coef",)),
    Rule(
        f"{A}.kl_loss_type",
        "low_var_kl",
        ("actor.worker.kl_loss_type",),
        _registry_name("KL estimator", _kl_estimators),
    ),
    Rule(f"{A}.use_prefix_grouper", False, convert=_only(False, reason="prefix grouping is not implemented")),
    Rule(f"{A}.router_replay.mode", "disabled", convert=_only("disabled", reason="MoE router replay")),
    Rule(f"{A}.freeze_vision_tower", False, convert=_only(False, reason="vision models are not supported")),
    Rule(f"{A}.calculate_sum_pi_squared", False, convert=_only(False, reason="not implemented")),
    # ----- actor: batches, optimiser, layout
    *_batch_rules(A, "actor.worker", critic=False),
    *_optim_rules(A, 1e-6, "actor.worker"),
    *_model_rules(M, "actor.worker", f"{A}.strategy"),
    Rule(f"{M}.mtp.enable", False, convert=_only(False, reason="multi-token prediction is not implemented")),
    Rule(f"{M}.tokenizer_path", None, ("model.tokenizer_path",), _optional_path, "`~` expanded"),
    # ----- rollout
    Rule(f"{R}.n", 1, ("rollout.n",)),
    Rule(f"{R}.temperature", 1.0, ("rollout.temperature",)),
    Rule(f"{R}.top_p", 1.0, ("rollout.top_p",)),
    Rule(f"{R}.top_k", -1, convert=_only(-1, 0, None, reason="top-k sampling is not implemented")),
    Rule(f"{R}.response_length", Ref("data.max_response_length"), ("rollout.max_new_tokens",)),
    Rule(f"{R}.do_sample", True, convert=_only(True, reason="PPO trains on sampled responses")),
    Rule(f"{R}.ignore_eos", False, convert=_only(False, reason="responses end at EOS")),
    Rule(f"{R}.over_sample_rate", 0, convert=_only(0, 0.0, reason="over-sampling is not implemented")),
    Rule(f"{R}.log_prob_micro_batch_size", None, doc="divided by the GPUs"),
    Rule(
        f"{R}.log_prob_micro_batch_size_per_gpu",
        None,
        ("actor.worker.forward_micro_batch_size",),
        _per_gpu(f"{R}.log_prob_micro_batch_size"),
        "or the deprecated global size / GPUs; also used for the reference pass",
    ),
    Rule(
        f"{R}.log_prob_use_dynamic_bsz",
        Ref(f"{A}.use_dynamic_bsz"),
        convert=_only(False, reason=_NO_DYNAMIC_BSZ),
    ),
    Rule(
        f"{F}.log_prob_use_dynamic_bsz",
        Ref(f"{A}.use_dynamic_bsz"),
        convert=_only(False, reason=_NO_DYNAMIC_BSZ),
    ),
    Rule(
        f"{F}.ulysses_sequence_parallel_size",
        Ref(f"{A}.ulysses_sequence_parallel_size"),
        convert=_only(1, reason=_NO_SP),
    ),
    Rule(f"{R}.val_kwargs.n", 1, ("rollout.val_n",)),
    Rule(f"{R}.val_kwargs.do_sample", False, ("rollout.val_do_sample",)),
    Rule(f"{R}.val_kwargs.temperature", 0, convert=_val_sampling(f"{R}.temperature")),
    Rule(f"{R}.val_kwargs.top_p", 1.0, convert=_val_sampling(f"{R}.top_p")),
    Rule(f"{R}.val_kwargs.top_k", -1, convert=_only(-1, 0, None, reason="top-k sampling is not implemented")),
    Rule(
        f"{R}.multi_turn.enable",
        False,
        convert=_only(False, reason="multi-turn rollouts are not implemented"),
    ),
    Rule(
        f"{R}.agent.default_agent_loop",
        "single_turn_agent",
        convert=_only("single_turn_agent", reason="agent loops are not implemented"),
    ),
    Rule(f"{R}.skip_rollout", False, convert=_only(False, reason="not supported")),
    Rule(f"{R}.enable_rollout_routing_replay", False, convert=_only(False, reason="MoE router replay")),
    Rule(f"{R}.quantization", None, convert=_only(None, reason="quantised rollouts are not implemented")),
    Rule(
        f"{R}.logprobs_mode",
        "processed_logprobs",
        convert=_logprobs_mode,
        doc="dropped while the rollout correction is off; with it on, only processed_logprobs (ppo-core's "
        "rollout log-probs are log_softmax(logits / temperature))",
    ),
    # ----- critic
    Rule("critic.enable", None, ("critic.enable",)),
    *_batch_rules(C, "critic.worker", critic=True),
    Rule(f"{C}.forward_micro_batch_size", Ref(f"{C}.ppo_micro_batch_size"), doc="divided by the GPUs"),
    Rule(
        f"{C}.forward_micro_batch_size_per_gpu",
        Ref(f"{C}.ppo_micro_batch_size_per_gpu"),
        ("critic.worker.forward_micro_batch_size",),
        _per_gpu(f"{C}.forward_micro_batch_size"),
        "or the deprecated global size / GPUs",
    ),
    Rule(f"{C}.cliprange_value", 0.5, ("critic.worker.cliprange_value",)),
    Rule(
        f"{C}.loss_scale_factor",
        None,
        ("critic.worker.loss_scale_factor",),
        _scale_factor(f"{C}.loss_agg_mode"),
        "None with `seq-mean-token-sum-norm`: `rollout.response_length` (verl's padded width)",
    ),
    Rule(
        f"{C}.loss_agg_mode",
        Ref(f"{A}.loss_agg_mode"),
        ("critic.worker.loss_agg_mode",),
        _registry_name("loss_agg_mode", _loss_agg_modes),
    ),
    *_optim_rules(C, 1e-5, "critic.worker"),
    *_model_rules(f"{C}.model", "critic.worker", f"{C}.strategy"),
    # ----- reward
    Rule("reward_model.enable", None, convert=_only(False, None, reason=_NO_REWARD_MODEL)),
    Rule("reward.reward_model.enable", False, convert=_only(False, None, reason=_NO_REWARD_MODEL)),
    Rule("custom_reward_function.path", None, convert=_only(None, reason=_CUSTOM_REWARD)),
    Rule("reward.custom_reward_function.path", None, convert=_only(None, reason=_CUSTOM_REWARD)),
    Rule(
        "reward.reward_manager.name",
        "naive",
        convert=_only("naive", reason="ppo-core scores each response alone, as verl's `naive` manager does"),
    ),
    Rule(
        "reward.reward_manager.module.path",
        None,
        convert=_only(
            None, reason="custom reward managers are not supported; write a scorer (`reward.scorers`)"
        ),
    ),
    Rule("sandbox_fusion.url", None, convert=_only(None, reason=_NO_SANDBOX)),
    Rule("reward.sandbox_fusion.url", None, convert=_only(None, reason=_NO_SANDBOX)),
    # ----- trainer
    Rule("trainer.total_epochs", 30, ("trainer.total_epochs",)),
    Rule("trainer.total_training_steps", None, ("trainer.total_training_steps",)),
    Rule("trainer.project_name", "verl_examples", doc="only in the default of `default_local_dir`"),
    Rule("trainer.experiment_name", "gsm8k", doc="only in the default of `default_local_dir`"),
    Rule(
        "trainer.logger",
        ["console", "wandb"],
        ("trainer.loggers",),
        _loggers,
        "console, tensorboard and wandb kept; other trackers (mlflow, ...) become `jsonl` (metrics.jsonl)",
    ),
    Rule("trainer.nnodes", 1, doc="x `n_gpus_per_node`"),
    Rule(
        "trainer.n_gpus_per_node",
        8,
        ("actor.world_size", "critic.world_size"),
        lambda v, get: _world_size(get),
        "`nnodes` x `n_gpus_per_node` (verl colocates actor and critic on all GPUs)",
    ),
    Rule("trainer.save_freq", -1, ("trainer.save_freq",), _disabled_as_zero, "-1 (off): 0"),
    Rule("trainer.resume_mode", "auto", ("trainer.resume_mode",), _resume_mode, "`resume_path`: `path`"),
    Rule(
        "trainer.resume_from_path",
        None,
        ("trainer.resume_from_path",),
        _resume_from_path,
        "dropped unless `resume_mode: resume_path` (verl reads it only then)",
    ),
    Rule("trainer.val_before_train", True, ("trainer.val_before_train",)),
    Rule("trainer.val_only", False, convert=_only(False, reason="call BasePPOTrainer's validation yourself")),
    Rule(
        "trainer.test_freq",
        -1,
        ("trainer.test_freq",),
        _disabled_as_zero,
        "-1 (off): 0 (ppo-core still validates after the last step)",
    ),
    Rule("trainer.critic_warmup", 0, ("trainer.critic_warmup",)),
    Rule(
        "trainer.default_local_dir",
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        ("trainer.default_local_dir",),
        _default_local_dir,
    ),
    Rule("trainer.default_hdfs_dir", None, convert=_only(None, reason="HDFS upload is not implemented")),
    Rule(
        "trainer.del_local_ckpt_after_load",
        False,
        convert=_only(False, reason="checkpoints are never deleted after loading"),
    ),
    Rule(
        "trainer.max_actor_ckpt_to_keep",
        None,
        convert=_only(None, reason="checkpoint rotation is not implemented yet"),
    ),
    Rule(
        "trainer.max_critic_ckpt_to_keep",
        None,
        convert=_only(None, reason="checkpoint rotation is not implemented yet"),
    ),
    Rule("trainer.device", "cuda", convert=_only("cuda", "cpu", reason="the workers run on CUDA or CPU")),
    Rule("transfer_queue.enable", False, convert=_only(False, reason="not supported")),
)
"""Every verl key the converter reads, in the order of the migration guide's table."""

JOB_PATHS: tuple[str, ...] = (
    "model",
    "data.train_files",
    "data.val_files",
    "data.max_prompt_length",
    "data.prompt_key",
    "data.truncation",
    "data.chat_template_kwargs",
)
"""Targets that belong to a ``ppo-core`` job (``ppo_core_cli.config.JobConfig``), not to a :class:`PPOConfig`."""

_ENGINE = "engine, memory or speed setting: does not change what is computed"
_INPUT = "an input your own code provides (model, tokenizer, dataset, reward function)"
_LOGGING = "logging, profiling or dumps"
_DERIVED = "derived from other keys by verl"

_SCHEDULE_ONLY = "only read by a learning-rate schedule"


def _trainable_role_ignored(section: str) -> tuple[tuple[str, str], ...]:
    """The megatron engine and optimiser-schedule keys that the actor and the critic share."""
    megatron_engine = (
        "param_offload",
        "grad_offload",
        "optimizer_offload",
        "use_dist_checkpointing",
        "dist_checkpointing_path",
        "dist_checkpointing_prefix",
        "override_ddp_config",
        "override_transformer_config.recompute_granularity",
        "override_transformer_config.recompute_method",
        "override_transformer_config.recompute_modules",
        "override_transformer_config.recompute_num_layers",
        "override_transformer_config.attention_backend",
        "use_mbridge",
        "vanilla_mbridge",
        "use_remove_padding",
        "forward_only",
        "dynamic_context_parallel",
        "max_seqlen_per_dp_cp_rank",
        "dist_ckpt_optim_fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient",
        "entropy_from_logits_with_chunking",
        "entropy_from_logits_chunk_size",
        "pad_bshd_to_minibatch_max",
        "pad_to_length",
        "pad_to_length_bucket",
        "use_megatron_fsdp",
    )
    muon = (
        "muon_momentum",
        "muon_nesterov",
        "muon_split_qkv",
        "muon_scale_mode",
        "muon_coefficient_type",
        "muon_num_ns_steps",
        "muon_tp_mode",
        "muon_fp32_matmul_prec",
        "muon_extra_scale_factor",
        "muon_scalar_optimizer",
        "muon_match_adamw_update_rms",
    )
    schedule = (
        "min_lr_ratio",
        "num_cycles",
        "lr_decay_steps",
        "lr_warmup_init",
        "lr_wsd_decay_steps",
        "lr_wsd_decay_style",
        "min_lr",
        "use_checkpoint_opt_param_scheduler",
    )
    return (
        (f"{section}.megatron.seed", "initialisation comes from the checkpoint"),
        (f"{section}.megatron.dtype", "set the worker's model.dtype"),
        *((f"{section}.megatron.{name}", _ENGINE) for name in megatron_engine),
        (f"{section}.optim.total_training_steps", _DERIVED),
        *((f"{section}.optim.{name}", _SCHEDULE_ONLY) for name in schedule),
        *((f"{section}.optim.{name}", "read with optim.optimizer (Muon)") for name in muon),
        (f"{section}.megatron.router_replay", "read with megatron.router_replay.mode"),
    )


STRUCTURAL: tuple[tuple[str, str], ...] = (
    # (pattern, reason): a pattern matches the key and everything under it; "*" matches one segment, "**" any.
    ("defaults", "Hydra's defaults list: the converter composes it"),
    ("hydra", "Hydra's own settings"),
    ("model_engine", "Hydra's engine choice: the `strategy` keys say the same"),
    ("**._target_", "verl's dataclass targets"),
)
"""Keys of Hydra's and verl's machinery: they pass quietly whatever their value."""

REFUSED: tuple[tuple[str, str], ...] = (
    # (pattern, reason) for the switches of verl features ppo-core lacks: a value other than verl's default is
    # refused with the reason (their other keys are in IGNORED: they are read only when the switch is on).
    ("algorithm.filter_groups.enable", "DAPO's dynamic sampling (group filtering) is not implemented"),
    ("distillation.enabled", "distillation from teacher models is not implemented"),
    (
        "trainer.v1.trainer_mode",
        "the asynchronous (off-policy) trainer modes are not implemented; ppo-core's loop is `sync`",
    ),
    ("skip.*.enable", "skipping rollouts (replaying dumped ones) is not implemented"),
    ("**.qat.enable", "quantisation-aware training is not implemented"),
    ("**.router_replay.mode", "MoE router replay is not implemented"),
    ("**.mtp.enable", "multi-token prediction is not implemented"),
    ("**.mtp.enable_train", "multi-token prediction is not implemented"),
    ("**.mtp.enable_rollout", "multi-token prediction is not implemented"),
    ("actor_rollout_ref.actor.policy_loss.dro_beta", "read only by verl's `dro` loss, which ppo-core lacks"),
    (
        "reward.reward_manager.source",
        "custom reward managers are not supported; write a scorer (`reward.scorers`)",
    ),
    (f"{C}.fsdp.ulysses_sequence_parallel_size", _NO_SP),
    ("actor_rollout_ref.*.fsdp_config.ulysses_sequence_parallel_size", _NO_SP),
)
"""Switches of features ppo-core does not have: refused, with the reason, unless at verl's default."""

IGNORED: tuple[tuple[str, str], ...] = (
    # (pattern, reason): keys that do not change what is computed; one set away from verl's default is dropped
    # and listed (at the default it passes quietly).
    ("**.profiler", _LOGGING),
    ("global_profiler", _LOGGING),
    ("ray_kwargs", "Ray start-up"),
    ("ray_init", "Ray start-up"),
    ("transfer_queue", _ENGINE),
    # algorithm
    ("algorithm.pf_ppo", "read with algorithm.use_pf_ppo"),
    ("algorithm.filter_groups", "read with algorithm.filter_groups.enable"),
    ("data.gen_batch_size", "read with algorithm.filter_groups.enable"),
    ("distillation", "read with distillation.enabled"),
    ("trainer.v1", "read with trainer.v1.trainer_mode (the asynchronous modes)"),
    ("trainer.use_v1", _ENGINE),
    ("trainer.checkpoint_callback_class", "a hook run after each checkpoint save; ppo-core calls none"),
    ("skip", "read with skip.*.enable"),
    ("**.qat", "read with qat.enable"),
    ("**.mtp", "read with mtp.enable"),
    (
        "reward.num_workers",
        "scoring processes (ppo-core's `reward.num_workers` defaults to scoring in-process)",
    ),
    ("reward.reward_manager", "read with reward.reward_manager.name"),
    ("reward.custom_reward_function", "read with reward.custom_reward_function.path"),
    ("reward.reward_model", "read with reward.reward_model.enable"),
    ("reward.sandbox_fusion", "read with reward.sandbox_fusion.url"),
    ("sandbox_fusion", "read with sandbox_fusion.url"),
    ("data.audio_key", _INPUT),
    ("data.mm_processor_kwargs", _INPUT),
    ("data.function_tool_path", "read with rollout.multi_turn.enable"),
    # data
    ("data.tokenizer", _INPUT),
    ("data.use_shm", _ENGINE),
    ("data.tool_config_path", _INPUT),
    ("data.return_raw_input_ids", _INPUT),
    ("data.return_raw_chat", _INPUT),
    ("data.return_full_prompt", _INPUT),
    ("data.dataloader_num_workers", _ENGINE),
    ("data.image_patch_size", _INPUT),
    ("data.filter_overlong_prompts_workers", _INPUT),
    ("data.image_key", _INPUT),
    ("data.video_key", _INPUT),
    ("data.trust_remote_code", _INPUT),
    ("data.custom_cls", "read with data.custom_cls.path"),
    ("data.return_multi_modal_inputs", _INPUT),
    ("data.sampler.class_name", "read with data.sampler.class_path"),
    ("data.datagen.name", "read with data.datagen.path"),
    # actor / ref / rollout / model
    ("actor_rollout_ref.hybrid_engine", _ENGINE),
    ("actor_rollout_ref.nccl_timeout", _ENGINE),
    ("actor_rollout_ref.*.rollout_n", _DERIVED),
    ("actor_rollout_ref.*.use_torch_compile", _ENGINE),
    ("actor_rollout_ref.*.fsdp_config", _ENGINE),
    ("actor_rollout_ref.*.entropy_from_logits_with_chunking", _ENGINE),
    ("actor_rollout_ref.*.entropy_checkpointing", _ENGINE),
    ("actor_rollout_ref.*.entropy_from_logits_chunk_size", _ENGINE),
    ("actor_rollout_ref.*.pad_to_length", _ENGINE),
    ("actor_rollout_ref.*.optim.zero_indexed_step", _SCHEDULE_ONLY),
    ("actor_rollout_ref.*.load_weight", _ENGINE),
    ("actor_rollout_ref.*.router_replay", "read with actor.router_replay.mode"),
    (f"{A}.ppo_max_token_len_per_gpu", "only read with use_dynamic_bsz"),
    (f"{A}.calculate_entropy", "ppo-core's workers always report the entropy"),
    (f"{A}.checkpoint", "ppo-core checkpoints model, optimiser and generator states"),
    (f"{A}.use_fused_kernels", _ENGINE),
    (f"{A}.use_remove_padding", _ENGINE),
    (f"{A}.sum_pi_squared_checkpointing", _ENGINE),
    *_trainable_role_ignored(A),
    (f"{F}.strategy", "the reference follows the actor"),
    (f"{F}.megatron", "the reference follows the actor's layout"),
    (f"{F}.log_prob_micro_batch_size", "the reference pass uses rollout.log_prob_micro_batch_size_per_gpu"),
    (
        f"{F}.log_prob_micro_batch_size_per_gpu",
        "the reference pass uses the actor's forward_micro_batch_size",
    ),
    (f"{F}.log_prob_max_token_len_per_gpu", "only read with use_dynamic_bsz"),
    (f"{R}.name", "the rollout engine (ppo-core's worker samples with its own engine)"),
    (f"{R}.mode", _ENGINE),
    (f"{R}.prompt_length", _INPUT),
    (f"{R}.log_prob_max_token_len_per_gpu", "only read with use_dynamic_bsz"),
    (
        f"{R}.calculate_log_probs",
        "ppo-core's rollout always returns its log-probs (algorithm.rollout_correction reads them)",
    ),
    (f"{R}.multi_turn", "read with multi_turn.enable"),
    (f"{R}.agent", "read with agent.default_agent_loop"),
    (f"{R}.skip_dump_dir", "read with skip_rollout"),
    (f"{R}.quantization_config_file", "read with quantization"),
    (f"{R}.mtp", "read with model.mtp.enable"),
    (f"{R}.seed", "the rollout engine's seed: ppo-core's sampling draws from the actor worker's generator"),
    (f"{R}.moe_load_balance_metrics_interval", _LOGGING),
    *(
        (f"{R}.{name}", _ENGINE)
        for name in (
            "dtype",
            "gpu_memory_utilization",
            "enforce_eager",
            "cudagraph_capture_sizes",
            "free_cache_engine",
            "tensor_model_parallel_size",
            "data_parallel_size",
            "expert_parallel_size",
            "pipeline_model_parallel_size",
            "max_num_batched_tokens",
            "max_model_len",
            "max_num_seqs",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "scheduling_policy",
            "load_format",
            "disable_log_stats",
            "engine_kwargs",
            "multi_stage_wake_up",
            "checkpoint_engine",
            "trace",
            "prometheus",
            "layered_summon",
            "skip_tokenizer_init",
            "layer_name_map",
            "disaggregation",
            "full_determinism",
            "n_gpus_per_node",
            "nnodes",
            "router_config_path",
        )
    ),
    *(
        (f"{M}.{name}", _INPUT)
        for name in (
            "hf_config_path",
            "custom_chat_template",
            "external_lib",
            "trust_remote_code",
        )
    ),
    *(
        (f"{M}.{name}", _ENGINE)
        for name in (
            "use_shm",
            "enable_gradient_checkpointing",
            "enable_activation_offload",
            "use_remove_padding",
            "use_liger",
            "use_fused_kernels",
            "fused_kernel_options",
            "tiled_mlp",
        )
    ),
    *(
        (f"{M}.{name}", "read with lora_rank")
        for name in ("lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path", "lora")
    ),
    (f"{M}.mtp", "read with mtp.enable"),
    # critic
    (f"{C}.rollout_n", _DERIVED),
    (f"{C}.nccl_timeout", _ENGINE),
    (f"{C}.load_weight", _ENGINE),
    (f"{C}.checkpoint", "ppo-core checkpoints model, optimiser and generator states"),
    (f"{C}.ppo_max_token_len_per_gpu", "only read with use_dynamic_bsz"),
    (f"{C}.forward_max_token_len_per_gpu", "only read with use_dynamic_bsz"),
    *_trainable_role_ignored(C),
    (f"{C}.model.fsdp_config", _ENGINE),
    (f"{C}.fsdp", "the critic's engine settings: " + _ENGINE),
    (f"{C}.optim.zero_indexed_step", _SCHEDULE_ONLY),
    (f"{C}.model.hf_config_path", _INPUT),
    (f"{C}.model.custom_chat_template", _INPUT),
    *((f"{C}.model.{name}", _ENGINE) for name in ("use_liger", "use_fused_kernels", "fused_kernel_options")),
    *((f"{C}.model.{name}", "read with lora_rank") for name in ("exclude_modules", "lora_adapter_path")),
    (f"{C}.model.mtp", "read with mtp.enable"),
    *((f"{C}.model.{name}", _INPUT) for name in ("tokenizer_path", "external_lib", "trust_remote_code")),
    *(
        (f"{C}.model.{name}", _ENGINE)
        for name in (
            "use_shm",
            "enable_gradient_checkpointing",
            "enable_activation_offload",
            "use_remove_padding",
            "tiled_mlp",
        )
    ),
    *((f"{C}.model.{name}", "read with lora_rank") for name in ("lora_alpha", "target_modules", "lora")),
    # reward
    ("reward_model", "read with reward_model.enable"),
    ("reward_manager", _INPUT),
    ("custom_reward_function", _INPUT),
    # trainer
    ("trainer.balance_batch", "reorders rows to balance tokens over ranks; the update is the same"),
    ("trainer.log_val_generations", _LOGGING),
    ("trainer.rollout_data_dir", _LOGGING),
    ("trainer.validation_data_dir", _LOGGING),
    ("trainer.esi_redundant_time", _ENGINE),
    ("trainer.ray_wait_register_center_timeout", _ENGINE),
    ("trainer.use_legacy_worker_impl", _ENGINE),
)
"""Keys that do not change what is computed, with the reason; the converter skips them."""
