"""Algorithm presets: one name for the keys that make an algorithm (estimator, critic, where the KL goes, responses
per prompt), as defaults that the config's own keys override.

========  ====================================================================================================
preset    keys it sets
========  ====================================================================================================
``ppo``   ``algorithm.adv_estimator=gae`` (so the critic runs), ``algorithm.use_kl_in_reward=true``,
          ``algorithm.kl_penalty=kl``, ``actor.use_kl_loss=false``, ``rollout.n=1``: PPO as in InstructGPT, KL to
          the reference as a per-token reward penalty.
``grpo``  ``algorithm.adv_estimator=grpo``, ``algorithm.norm_adv_by_std_in_grpo=true``,
          ``algorithm.use_kl_in_reward=false``, ``actor.use_kl_loss=true``,
          ``actor.worker.kl_loss_type=low_var_kl``, ``actor.worker.kl_loss_coef=0.001``, ``rollout.n=8``: group
          advantages, no critic, KL to the reference as a loss term (DeepSeekMath's GRPO, verl's defaults).
``rloo``  ``algorithm.adv_estimator=rloo``, ``algorithm.use_kl_in_reward=true``, ``algorithm.kl_penalty=kl``,
          ``actor.use_kl_loss=false``, ``rollout.n=4``: leave-one-out baseline
          over the group, no critic, KL in the reward.
========  ====================================================================================================

With any preset, the actor worker's own switch ``actor.worker.use_kl_loss`` follows ``actor.use_kl_loss`` unless
the config sets it (the two must agree: :class:`~ppo_core.trainer.ActorConfig`).

Semantics: the preset's values are defaults. A key the config sets itself (in the file or as an override) keeps
the config's value, whatever its order; :func:`preset_overridden` lists such keys (the command logs them). The
``actor.worker`` keys are those of ppo-core's workers (a custom worker must accept them, or be configured without a
preset). Coefficients (``kl_ctrl.kl_coef``, learning rates) and batch sizes stay the config's: they depend on the
model and the task, not on the algorithm.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["PRESETS", "apply_preset", "preset_overridden"]

_NO_KL_LOSS = {"use_kl_loss": False}

PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {
        "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True, "kl_penalty": "kl"},
        "actor": _NO_KL_LOSS,
        "rollout": {"n": 1},
    },
    "grpo": {
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False},
        "actor": {
            "use_kl_loss": True,
            "worker": {"kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001},
        },
        "rollout": {"n": 8},
    },
    "rloo": {
        "algorithm": {"adv_estimator": "rloo", "use_kl_in_reward": True, "kl_penalty": "kl"},
        "actor": _NO_KL_LOSS,
        "rollout": {"n": 4},
    },
}
"""``{name: the config keys it sets, as a nested dict}`` (see the module docstring)."""


def _check(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid values: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def _defaults_under(defaults: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: copy.deepcopy(v) for k, v in defaults.items()}
    for key, value in config.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _defaults_under(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_preset(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a nested dict of :class:`~ppo_core.trainer.PPOConfig` keys) with the preset's keys added where
    it does not set them.

    Example:
        >>> cfg = apply_preset("grpo", {"rollout": {"n": 4}, "data": {"train_batch_size": 16}})
        >>> cfg["rollout"]["n"], cfg["algorithm"]["adv_estimator"], cfg["actor"]["use_kl_loss"]
        (4, 'grpo', True)
    """
    out = _defaults_under(_check(name), config)
    actor = out.setdefault("actor", {})
    worker = actor.setdefault("worker", {})
    worker.setdefault(
        "use_kl_loss", actor.get("use_kl_loss", False)
    )  # the worker's loss follows the trainer's
    return out


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def preset_overridden(name: str, config: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, preset's value, config's value)`` of the preset's keys that ``config`` sets differently.

    Example:
        >>> preset_overridden("grpo", {"rollout": {"n": 4}, "algorithm": {"adv_estimator": "grpo"}})
        [('rollout.n', 8, 4)]
    """
    out = []
    for key, value in _leaves(_check(name)):
        node: Any = config
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is not _MISSING and node != value:
            out.append((key, value, node))
    return out


_MISSING = object()
