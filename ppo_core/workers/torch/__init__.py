"""PyTorch workers (actor/rollout/reference and critic) for any causal-LM ``nn.Module``: the PPO algorithm of
:mod:`ppo_core.workers.ppo` on :class:`TorchEngine` (DDP when ``world_size > 1``, AdamW).

Modules: :mod:`~ppo_core.workers.torch.engine` (the engine), :mod:`~ppo_core.workers.torch.workers`
(``TorchActorWorker``, ``TorchCriticWorker``), :mod:`~ppo_core.workers.torch.config`,
:mod:`~ppo_core.workers.torch.distributed` (process group, DDP), :mod:`~ppo_core.workers.torch.exact` (exact on-policy
log-probs, ``exact_log_probs``). The sampling functions are re-exported from
:mod:`ppo_core.rollout`.

Example:
    >>> import functools
    >>> from ppo_core.backends.local import LocalWorkerGroup
    >>> from ppo_core.models import TinyGPT, TinyGPTConfig
    >>> from ppo_core.workers import WorkerSpec
    >>> lm = functools.partial(TinyGPT, TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
    >>> actor_wg = LocalWorkerGroup(WorkerSpec(TorchActorWorker, (lm, {"ppo_mini_batch_size": 2})))
"""

from __future__ import annotations

from ppo_core.rollout import SamplingConfig, generate, sample_from_logits, top_p_filter
from ppo_core.workers.config import OptimConfig
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig
from ppo_core.workers.torch.engine import TorchEngine
from ppo_core.workers.torch.workers import TorchActorWorker, TorchCriticWorker

__all__ = [
    "OptimConfig",
    "SamplingConfig",
    "TorchActorConfig",
    "TorchActorWorker",
    "TorchCriticConfig",
    "TorchCriticWorker",
    "TorchEngine",
    "generate",
    "sample_from_logits",
    "top_p_filter",
]
