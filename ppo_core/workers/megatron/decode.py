"""Deprecated alias of :mod:`ppo_core_decode.megatron` (the megatron decode forward, now in the decode engine's own
package; its support check :func:`~ppo_core.workers.megatron.rollout.own_forward_unsupported` moved to the
megatron engine); removed in ppo-core 0.2."""

from ppo_core._moved import alias_module

alias_module(__name__, "ppo_core_decode.megatron", globals())

from ppo_core.workers.megatron.rollout import own_forward_unsupported  # noqa: E402

__all__ = [*__all__, "own_forward_unsupported"]  # noqa: F821
