"""``FusedNorm``: megatron's norm slot with parameters in the model dtype, computed by one fused kernel.

Without Transformer Engine or Apex, megatron-core's local layer spec normalises with ``torch.nn.RMSNorm`` built
in fp32 (megatron expects a ``Float16Module`` wrapper to cast it), so every bf16 activation goes through
PyTorch's composite RMSNorm: about eight fp32 passes forward and more backward. :class:`FusedNorm` calls
:func:`ppo_core.kernels.fused.rms_norm` instead (one kernel on CUDA). The rotary embedding is applied by
:class:`~ppo_core.workers.megatron.model.SDPACoreAttention` with :func:`ppo_core.kernels.fused.apply_rotary`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppo_core.kernels.fused import apply_rotary, rms_norm, rotary_tables

__all__ = ["FusedNorm", "apply_rotary", "rms_norm", "rotary_tables"]


class FusedNorm(nn.Module):
    """megatron's norm slot (``input_layernorm``, ``pre_mlp_layernorm``, ``final_layernorm``), parameters in the
    model dtype: :func:`rms_norm` for ``RMSNorm``, ``F.layer_norm`` for ``LayerNorm``.

    Built by megatron as ``FusedNorm(config=..., hidden_size=..., eps=...)``; the parameters keep
    ``torch.nn.RMSNorm`` / ``LayerNorm``'s names (``weight``, ``bias``), so checkpoints and Hugging Face loading
    are unchanged. With sequence parallelism the parameters are marked ``sequence_parallel`` so that megatron
    all-reduces their gradients over the tensor-parallel group.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"FusedNorm supports RMSNorm and LayerNorm, got normalization={config.normalization!r}"
            )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = {"dtype": config.params_dtype, "device": device}
        self.rms = config.normalization == "RMSNorm"
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, **kw))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, **kw))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D] -> [..., D]`` in ``x.dtype``."""
        if self.rms:
            return rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)
