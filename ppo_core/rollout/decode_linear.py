"""Deprecated alias of :mod:`ppo_core_decode.decode_linear` (the decode engine's own package); removed in ppo-core 0.2."""

from ppo_core._moved import alias_module

alias_module(__name__, "ppo_core_decode.decode_linear", globals())
