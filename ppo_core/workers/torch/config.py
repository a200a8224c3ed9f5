"""Configs of the reference PyTorch workers: optimiser, actor (with rollout and reference), critic."""

from __future__ import annotations

from dataclasses import dataclass, field

from ppo_core._checks import check_int, check_positive
from ppo_core._config_base import ConfigBase
from ppo_core.kl import KLEstimator
from ppo_core.losses import PolicyLossConfig
from ppo_core.losses.aggregation import LossAggMode
from ppo_core.workers.torch.sampling import SamplingConfig

__all__ = ["OptimConfig", "TorchActorConfig", "TorchCriticConfig"]


def _check_batch_sizes(cfg: ActorCriticCommon) -> None:
    check_int("ppo_epochs", cfg.ppo_epochs, 1)
    check_int("ppo_mini_batch_size", cfg.ppo_mini_batch_size, 1)
    for name in ("micro_batch_size", "forward_micro_batch_size"):
        if getattr(cfg, name) is not None:
            check_int(name, getattr(cfg, name), 1)


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
class ActorCriticCommon(ConfigBase):
    """Fields shared by the actor and the critic: device, seed, epochs and batch sizes."""

    device: str | None = None
    """Torch device; None picks ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    seed: int = 0
    """Seeds the worker's generator (sampling and mini-batch shuffling); rank ``r`` uses ``seed + r``."""
    ppo_epochs: int = 1
    """Passes over each batch in an update."""
    ppo_mini_batch_size: int = 256
    """Rows (responses) per optimiser step, counted over all data-parallel ranks (each rank gets 1/dp_size)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward on one rank (gradient accumulation); None: the whole local mini-batch."""
    forward_micro_batch_size: int | None = None
    """Rows per forward pass when only computing log-probs/values; None: the whole batch."""
    shuffle: bool = False
    """Shuffle the rows before cutting mini-batches (verl's default is False)."""
    loss_scale_factor: float | None = None
    """Constant divisor of ``seq-mean-token-sum-norm`` aggregation (e.g. the response length)."""


@dataclass(kw_only=True)
class TorchActorConfig(ActorCriticCommon):
    """Actor (policy update), rollout (sampling) and reference (frozen initial policy) settings."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser of the policy."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Registry policy loss, its clip ranges and its ``loss_agg_mode`` (also used for entropy and KL terms)."""
    rollout: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling settings; its temperature also scales the logits of every log-prob computation."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus: ``loss = pg_loss - entropy_coeff * entropy``."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(policy || reference)`` to the actor loss (GRPO style); needs ``ref_log_prob``."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss (a name accepted by :func:`ppo_core.kl.kl_penalty`)."""
    use_reference: bool = True
    """Keep a frozen copy of the initial policy for ``compute_ref_log_prob``."""

    def __post_init__(self) -> None:
        _check_batch_sizes(self)
        check_positive("entropy_coeff", self.entropy_coeff, allow_zero=True)
        check_positive("kl_loss_coef", self.kl_loss_coef, allow_zero=True)


@dataclass(kw_only=True)
class TorchCriticConfig(ActorCriticCommon):
    """Critic (value model) settings."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimiser of the value model."""
    cliprange_value: float = 0.5
    """Clip range of the value prediction around the rollout values (verl's default)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Aggregation of the value loss (:data:`ppo_core.losses.LOSS_AGG_MODES`)."""

    def __post_init__(self) -> None:
        _check_batch_sizes(self)
        check_positive("cliprange_value", self.cliprange_value)
