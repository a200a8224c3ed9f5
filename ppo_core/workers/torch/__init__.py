"""Reference PyTorch workers (actor/rollout/reference and critic) for any causal-LM ``nn.Module``.

Example:
    >>> import functools
    >>> from ppo_core.backends.local import LocalWorkerGroup
    >>> from ppo_core.models import TinyGPT, TinyGPTConfig
    >>> from ppo_core.workers import WorkerSpec
    >>> lm = functools.partial(TinyGPT, TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
    >>> actor_wg = LocalWorkerGroup(WorkerSpec(TorchActorWorker, (lm, {"ppo_mini_batch_size": 2})))
"""

from __future__ import annotations

from ppo_core.workers.torch.actor import TorchActorWorker
from ppo_core.workers.torch.config import OptimConfig, TorchActorConfig, TorchCriticConfig
from ppo_core.workers.torch.critic import TorchCriticWorker
from ppo_core.workers.torch.sampling import SamplingConfig, generate, sample_from_logits, top_p_filter

__all__ = [
    "OptimConfig",
    "SamplingConfig",
    "TorchActorConfig",
    "TorchActorWorker",
    "TorchCriticConfig",
    "TorchCriticWorker",
    "generate",
    "sample_from_logits",
    "top_p_filter",
]
