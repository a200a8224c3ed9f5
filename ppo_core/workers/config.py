"""Configs of the PPO workers, engine-neutral: optimiser, actor (with rollout and reference), critic.

Engines add their own fields by subclassing (:class:`ppo_core.workers.torch.TorchActorConfig` adds ``device``,
:class:`ppo_core.workers.megatron.MegatronActorConfig` the model shape and parallel layout); the field names
are the keys of the dicts users pass to the worker constructors.

Example:
    >>> cfg = PPOActorConfig.from_dict({"ppo_mini_batch_size": 4, "policy_loss": {"clip_ratio": 0.1}})
    >>> cfg.policy_loss.clip_ratio, cfg.optim.lr
    (0.1, 1e-06)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from ppo_core._checks import FieldValueError, check_int, check_positive
from ppo_core._config_base import ConfigBase
from ppo_core.kl import KLEstimator
from ppo_core.losses import PolicyLossConfig
from ppo_core.losses.aggregation import LossAggMode
from ppo_core.rollout.sampling import SamplingConfig

__all__ = ["ModelSource", "OptimConfig", "PPOActorConfig", "PPOCriticConfig", "PPOWorkerConfig"]

W = TypeVar("W", bound="PPOWorkerConfig")


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """What a run knows of a role's model before its workers are built: what :meth:`PPOWorkerConfig.resolved`
    completes a worker config from (an engine that builds its model from the checkpoint reads its shape there)."""

    checkpoint: str
    """The Hugging Face checkpoint directory the role starts from."""
    dtype: str = "float32"
    """Parameter dtype of the run's models (``float32``, ``bfloat16``, ``float16``)."""
    value_head_init_std: float = 0.0
    """Standard deviation of a critic's new value head (0: zeros)."""
    seed: int = 0
    """Seed of that initialisation."""


@dataclass(kw_only=True)
class OptimConfig(ConfigBase):
    """AdamW settings and gradient clipping."""

    lr: float = 1e-6
    """Learning rate (verl's actor default; the critic's is 1e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (verl's default)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient L2 norm to this value before each step; None disables clipping."""

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        if self.grad_clip is not None:
            check_positive("grad_clip", self.grad_clip)


@dataclass(kw_only=True)
class PPOWorkerConfig(ConfigBase):
    """Fields shared by the actor and the critic: seed, epochs and batch sizes."""

    seed: int = 0
    """Seeds the worker's generators (sampling and mini-batch shuffling); data-parallel rank ``r`` uses
    ``seed + r`` (tensor/pipeline-parallel peers share it)."""
    ppo_epochs: int = 1
    """Passes over each batch in an update."""
    ppo_mini_batch_size: int = 256
    """Rows (responses) per optimiser step, counted over all data-parallel ranks (each rank gets 1/dp_size)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward on one rank (gradient accumulation); None: the whole local mini-batch."""
    forward_micro_batch_size: int | None = None
    """Rows per forward pass when only computing log-probs/values; None: the whole batch."""
    ppo_max_token_len_per_gpu: int | None = None
    """Token budget of one forward/backward on one rank: each local mini-batch is cut into the fewest micro-batches
    of at most this many valid tokens (``attention_mask`` sums), balanced by Karmarkar-Karp; a longer row gets a
    micro-batch of its own. Replaces ``micro_batch_size`` (set one of the two); None: row counts."""
    forward_max_token_len_per_gpu: int | None = None
    """Token budget of one forward pass when only computing log-probs/values (replaces
    ``forward_micro_batch_size``; set one of the two); None: row counts."""
    use_remove_padding: Literal["auto", True, False] = "auto"
    """Run the model on the valid tokens only, packed into one sequence per micro-batch (per-row causal attention
    and positions). ``"auto"``: where the packed attention skips the work across documents (megatron with
    ``attention="sdpa"``; a torch model declaring ``supports_packed_sequences``, unless it declares
    ``packed_attention_is_sparse = False``: the Hugging Face wrappers pack with the ``flash_attention_*`` and
    ``flex_attention`` implementations, not with ``sdpa``/``eager``, whose block mask is a dense ``[N, N]`` over the
    whole packed length). True: wherever the model supports it. False: padded rows."""
    shuffle: bool = False
    """Shuffle the rows before cutting mini-batches (verl's default is False)."""
    loss_scale_factor: float | None = None
    """Constant divisor of ``seq-mean-token-sum-norm`` aggregation (e.g. the response length)."""

    def __post_init__(self) -> None:
        check_int("ppo_epochs", self.ppo_epochs, 1)
        check_int("ppo_mini_batch_size", self.ppo_mini_batch_size, 1)
        for name in (
            "micro_batch_size",
            "forward_micro_batch_size",
            "ppo_max_token_len_per_gpu",
            "forward_max_token_len_per_gpu",
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        for rows, tokens in (
            ("micro_batch_size", "ppo_max_token_len_per_gpu"),
            ("forward_micro_batch_size", "forward_max_token_len_per_gpu"),
        ):
            if getattr(self, rows) is not None and getattr(self, tokens) is not None:
                raise ValueError(
                    f"set either {rows} (rows per micro-batch) or {tokens} (tokens per micro-batch), not both; "
                    f"got {rows}={getattr(self, rows)} and {tokens}={getattr(self, tokens)}"
                )

    # ----- a run's worker config: checked when the job is read, completed once the checkpoint is known ----------
    RUN_KEYS: ClassVar[tuple[str, ...]] = ()
    """Dotted keys that :meth:`resolved` sets from the run's :class:`ModelSource`: a job may not set them."""

    @classmethod
    def unresolved(cls: type[W], data: Mapping[str, Any] | None = None) -> W:
        """The config of a job's worker section before the run resolves it (:meth:`resolved`): ``data`` checked
        (types, ranges, unknown keys) with the :attr:`RUN_KEYS` refused, naming the key, and filled with
        placeholders (:meth:`_run_placeholders`) until the run sets them."""
        data = dict(data or {})
        for key in cls.RUN_KEYS:
            head, _, tail = key.partition(".")
            inner = data.get(head)
            if (head in data) if not tail else isinstance(inner, Mapping) and tail in inner:
                raise FieldValueError(key, " is set by the run from the model's checkpoint; remove it")
        for head, value in cls._run_placeholders().items():
            inner = data.get(head, {})
            data[head] = (
                {**value, **inner} if isinstance(inner, Mapping) else inner
            )  # a bad type shows its error
        return cls.from_dict(data)

    @classmethod
    def _run_placeholders(cls) -> dict[str, Any]:
        """``{section: keys}`` that stand in for :attr:`RUN_KEYS` until :meth:`resolved` (none here)."""
        return {}

    def resolved(self: W, source: ModelSource) -> W:
        """This config completed for a run whose model is ``source`` (the :attr:`RUN_KEYS` set): what the worker
        receives. Engines that load the checkpoint themselves need nothing, so this one is returned as it is."""
        return self

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks of a group of ``world_size`` ranks (here: every rank is one); each takes an equal
        share of a mini-batch."""
        return check_int("world_size", world_size, 1)

    def job_keys(self) -> dict[str, Any]:
        """:meth:`to_dict` without the :attr:`RUN_KEYS`: what a job's worker section writes."""
        out = self.to_dict()
        for key in self.RUN_KEYS:
            head, _, tail = key.partition(".")
            if tail:
                out.get(head, {}).pop(tail, None)
            else:
                out.pop(head, None)
        return out


@dataclass(kw_only=True)
class PPOActorConfig(PPOWorkerConfig):
    """Actor (policy update), rollout (sampling) and reference (frozen initial policy) settings."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser of the policy."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Registry policy loss, its clip ranges and its ``loss_agg_mode`` (also used for entropy and KL terms)."""
    rollout: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling settings; its temperature also scales the logits of every log-prob computation."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus: ``loss = pg_loss - entropy_coeff * entropy`` (0: entropy not computed)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(policy || reference)`` to the actor loss (GRPO style); needs ``ref_log_probs``."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss (a name accepted by :func:`ppo_core.kl.kl_penalty`)."""
    kl_loss_importance_weighted: bool = False
    """Weight each token's KL estimate by the importance ratio ``pi / pi_old`` (not detached), which makes the
    estimate unbiased for tokens sampled from ``pi_old`` (:func:`ppo_core.kl.importance_weighted_kl`; TRL's
    ``use_bias_correction_kl``)."""
    use_reference: bool = True
    """Keep a frozen copy of the initial policy for ``compute_ref_log_prob``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("entropy_coeff", self.entropy_coeff, allow_zero=True)
        check_positive("kl_loss_coef", self.kl_loss_coef, allow_zero=True)


@dataclass(kw_only=True)
class PPOCriticConfig(PPOWorkerConfig):
    """Critic (value model) settings."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimiser of the value model."""
    cliprange_value: float = 0.5
    """Clip range of the value prediction around the rollout values (verl's default)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Aggregation of the value loss (:data:`ppo_core.losses.LOSS_AGG_MODES`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("cliprange_value", self.cliprange_value)
