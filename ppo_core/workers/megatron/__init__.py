"""PPO workers on megatron-core (extra ``megatron``): tensor / pipeline / data parallel GPT actor and critic.

Modules: :mod:`~ppo_core.workers.megatron.config` (model shape, parallel layout, worker configs),
:mod:`~ppo_core.workers.megatron.parallel` (megatron parallel state from the backend's ranks),
:mod:`~ppo_core.workers.megatron.model` (GPTModel with fused SDPA attention, value head),
:mod:`~ppo_core.workers.megatron.fused` (compiled RMSNorm and rotary embeddings, norms in the model dtype),
:mod:`~ppo_core.workers.megatron.linear` (linear layers accumulating weight gradients into fp32 main grads),
:mod:`~ppo_core.workers.megatron.optim` (megatron's optimizer without Apex: multi-tensor norm, clip, copy),
:mod:`~ppo_core.workers.megatron.vocab_parallel` (log-probs / entropy without gathering the vocabulary),
:mod:`~ppo_core.workers.megatron.hf_loading` (Hugging Face Llama/Qwen2 safetensors),
:mod:`~ppo_core.workers.megatron.engine` (``MegatronEngine``: the training-engine protocol over megatron's pipeline
schedules, DDP and optimizer),
:mod:`~ppo_core.workers.megatron.workers` (``MegatronActorWorker``, ``MegatronCriticWorker``: the PPO workers of
:mod:`ppo_core.workers.ppo` on megatron engines).

Only ``config``, ``parallel``, ``fused``, ``optim`` and ``vocab_parallel`` import without megatron-core; the model,
loading, engine and worker modules import it lazily (on first use of their functions) or at import time.

Example:
    >>> from ppo_core.workers.megatron import MegatronModelConfig, ParallelConfig
    >>> ParallelConfig(tensor_model_parallel_size=2).data_parallel_size(4)
    2
"""

from __future__ import annotations

from typing import Any

from ppo_core.workers.megatron.config import (
    NORMS,
    MegatronActorConfig,
    MegatronCriticConfig,
    MegatronModelConfig,
    ParallelConfig,
)
from ppo_core.workers.megatron.parallel import (
    MegatronLayout,
    destroy_megatron_parallel,
    init_megatron_parallel,
    megatron_layout,
)
from ppo_core.workers.megatron.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)

__all__ = [
    "NORMS",
    "MegatronActorConfig",
    "MegatronActorWorker",
    "MegatronCriticConfig",
    "MegatronCriticWorker",
    "MegatronEngine",
    "MegatronLayout",
    "MegatronModelConfig",
    "ParallelConfig",
    "build_gpt_model",
    "destroy_megatron_parallel",
    "hf_to_megatron",
    "init_megatron_parallel",
    "load_hf_checkpoint",
    "megatron_layout",
    "megatron_to_hf",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
]

_LAZY = {
    "MegatronActorWorker": "ppo_core.workers.megatron.workers",
    "MegatronCriticWorker": "ppo_core.workers.megatron.workers",
    "MegatronEngine": "ppo_core.workers.megatron.engine",
    "build_gpt_model": "ppo_core.workers.megatron.model",
    "hf_to_megatron": "ppo_core.workers.megatron.hf_loading",
    "megatron_to_hf": "ppo_core.workers.megatron.hf_loading",
    "load_hf_checkpoint": "ppo_core.workers.megatron.hf_loading",
}


def __getattr__(name: str) -> Any:
    # the model and worker modules pull in megatron-core; keep `import ppo_core.workers.megatron` light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
