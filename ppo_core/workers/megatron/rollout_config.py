"""``MegatronEngineConfig``: the typed settings of the ``megatron`` rollout engine, checked once and building it.

Light on purpose (no megatron import): the engine module, :mod:`~ppo_core.workers.megatron.rollout`, is imported
by :meth:`MegatronEngineConfig.build`.

Example:
    >>> MegatronEngineConfig(fold_norms=False).fold_norms
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ppo_core_decode.config import CachedEngineConfig

__all__ = ["MegatronEngineConfig"]


@dataclass(kw_only=True)
class MegatronEngineConfig(CachedEngineConfig):
    """``megatron``: :class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine`, the KV-cached engine on the
    megatron actor's own ``GPTModel`` (built on the megatron actor worker's policy view)."""

    own_forward: bool | None = None
    """Decode with the engine's own evaluation of megatron's layers (True) or with ``GPTModel.forward`` (False);
    None: the former unless ``batch_invariant`` or the model is one it does not evaluate."""
    fold_norms: bool = True
    """With ``fused_decode``, copy the q/k/v and ``linear_fc1`` weights with the norm before each folded in
    (about half the weights again in memory, a shorter decode step); False copies no weight."""

    def build(self, model: nn.Module, sampling: Any) -> Any:
        """A :class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine` on the megatron actor worker's
        policy view ``model`` (its ``module``, ``model_config``, tensor-parallel group and size), with
        ``sampling.batch_invariant``."""
        from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

        module = getattr(model, "module", None)
        model_config = getattr(model, "model_config", None)
        if module is None or model_config is None:
            raise TypeError(
                "the megatron rollout engine is built on the megatron actor worker's policy (rollout.engine: "
                f"megatron needs MegatronActorWorker), got {type(model).__name__}"
            )
        return MegatronRolloutEngine(
            module,
            model_config,
            tp_group=model._tp_group,
            tp_size=model.layout.tp_size,
            batch_invariant=bool(sampling.batch_invariant),
            own_forward=self.own_forward,
            fused_decode=self.fused_decode,
            fold_norms=self.fold_norms,
            **self.decoder_options(),
        )
