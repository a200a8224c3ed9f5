"""Read a verl PPO config (a YAML file or a mapping) into ppo-core settings: :func:`convert_verl` gives the
settings of a ``ppo-core`` job and a report of every key, :func:`ppo_config_from_verl` the trainer's
:class:`~ppo_core.trainer.PPOConfig`.

verl splits the same settings differently: clip ratios, KL loss and mini-batch sizes live on
``actor_rollout_ref.actor``, sampling on ``actor_rollout_ref.rollout``, the GPU count on ``trainer``. The converter
puts each where ppo-core reads it: the controller's sections of :class:`PPOConfig`, the worker settings in
``actor.worker`` / ``critic.worker`` (dicts of :class:`~ppo_core.workers.torch.TorchActorConfig` /
:class:`~ppo_core.workers.torch.TorchCriticConfig` fields, or of the megatron configs when verl's ``strategy`` is
``megatron``), and the job's inputs (prompt files, ``max_prompt_length``, model paths; :data:`JOB_PATHS`). Keys
absent from the input take verl's defaults, so a verl config and its conversion train the same algorithm. The
table of every key is in ``docs/migrating-from-verl.md`` (and in :data:`ppo_core.compat._verl_keys.RULES`);
values change on the way where the two libraries count differently (``ppo_mini_batch_size`` is multiplied by
``rollout.n``: verl counts prompts, ppo-core responses).

Every key of the input ends in one of four places (:class:`VerlConversion`):

- **mapped**: it has a ppo-core counterpart (or feeds one);
- **quiet**: it is at verl's default (:data:`ppo_core.compat._verl_defaults.DEFAULTS`) or a switched-off feature,
  or it is Hydra's / verl's machinery (``defaults``, ``_target_``);
- **dropped**: it is set away from verl's default but does not change what is computed (engine, memory and speed
  knobs, logging; :data:`~ppo_core.compat._verl_keys.IGNORED`): listed with the reason;
- **refused**: it changes what verl computes and ppo-core has no counterpart (a feature it lacks switched on, an
  unknown name, a key verl 0.9.1 does not have): all of them in one ``ValueError``, each with its reason.

A file with a ``defaults:`` list (verl's ``ppo_trainer.yaml``) is composed first, and Hydra-style overrides are
applied (:mod:`ppo_core.compat._verl_compose`): ``convert_verl("ppo_trainer.yaml", ["data.train_files=..."])``
is what ``python -m verl.trainer.main_ppo data.train_files=...`` would train.

Needs OmegaConf (``pip install ppo-core[hf]``) for YAML files and verl's ``${...}`` interpolations.

Example:
    >>> cfg = ppo_config_from_verl({
    ...     "algorithm": {"adv_estimator": "grpo"},
    ...     "data": {"train_batch_size": 32},
    ...     "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8, "use_kl_loss": True},
    ...                           "rollout": {"n": 4}},
    ...     "trainer": {"n_gpus_per_node": 2},
    ... })
    >>> cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.world_size
    ('grpo', 4, 2)
    >>> cfg.actor.worker["ppo_mini_batch_size"]  # 8 prompts x 4 responses
    32
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_core._checks import _FieldError
from ppo_core.compat._verl_keys import (
    IGNORED,
    JOB_PATHS,
    REFUSED,
    RULES,
    SKIP,
    STRUCTURAL,
    Emit,
    Ref,
    Rule,
    Unsupported,
)
from ppo_core.compat._verl_load import Unresolved, VerlInput, at_default, known_key, load_user_keys
from ppo_core.trainer.config import PPOConfig

__all__ = ["VerlConversion", "convert_verl", "ppo_config_from_verl"]

logger = logging.getLogger(__name__)

_RULES: dict[str, Rule] = {rule.key: rule for rule in RULES}


@dataclass(frozen=True)
class VerlConversion:
    """What :func:`convert_verl` made of a verl config: the ppo-core settings and where each verl key went."""

    settings: dict[str, Any]
    """ppo-core settings, nested: :class:`PPOConfig`'s sections plus the job's inputs at :data:`JOB_PATHS`."""
    mapped: tuple[str, ...] = ()
    """The input's keys with a ppo-core counterpart (dotted)."""
    quiet: tuple[str, ...] = ()
    """The input's keys at verl's default or switched off, and Hydra's machinery: nothing to carry over."""
    dropped: dict[str, str] = field(default_factory=dict)
    """``"key=value"`` -> reason, for the input's keys set away from verl's default that ppo-core does not read
    (they do not change what is computed)."""
    strategy: str = "fsdp"
    """verl's actor strategy (``fsdp``, ``fsdp2`` or ``megatron``): which ppo-core workers fit."""

    @property
    def total(self) -> int:
        """How many keys the input had."""
        return len(self.mapped) + len(self.quiet) + len(self.dropped)

    def ppo_settings(self) -> dict[str, Any]:
        """:attr:`settings` without the job's inputs: what :meth:`PPOConfig.from_dict` reads."""
        out = _copy_tree(self.settings)
        for path in JOB_PATHS:
            *parents, leaf = path.split(".")
            node = out
            for part in parents:
                node = node.get(part, {})
            node.pop(leaf, None)
        return out


def convert_verl(cfg: VerlInput, overrides: Sequence[str] = ()) -> VerlConversion:
    """Convert a verl PPO trainer config into ppo-core settings, sorting every key (see the module docstring).

    Args:
        cfg: the path of a YAML file (composed, a primary config with a ``defaults:`` list, or overrides only),
            or a mapping (a dict or an OmegaConf ``DictConfig``) with verl's sections ``actor_rollout_ref``,
            ``critic``, ``algorithm``, ``data``, ``trainer`` (and others, which are checked too). ``${...}``
            interpolations are resolved, with verl's defaults available to them.
        overrides: Hydra-style ``key=value`` strings applied on top (as given to ``verl.trainer.main_ppo``).

    Returns:
        The settings (checked by :class:`PPOConfig` and the workers' configs) and the report of every key.

    Raises:
        ValueError: one error listing every key that is refused, with its value and the reason; or naming the
            verl key whose value ppo-core's configs reject.
        TypeError: ``cfg`` is neither a mapping nor a path.
        FileNotFoundError: ``cfg`` names a file that does not exist.
    """
    user, merged = load_user_keys(cfg, overrides)
    reader = _Reader(user)
    megatron = reader("actor_rollout_ref.actor.strategy") == "megatron"
    problems: list[str] = []
    quiet: list[str] = []
    dropped: dict[str, str] = {}
    for key in sorted(user):
        value = user[key]
        if isinstance(value, Unresolved):
            problems.append(f"{key}: {value}")
        elif key in _RULES:
            continue  # sorted below, with its rule
        elif _first_match(key, STRUCTURAL) is not None or at_default(key, value, merged, megatron):
            quiet.append(key)
        elif (reason := _first_match(key, REFUSED)) is not None:
            problems.append(f"{key}={value!r}: {reason}")
        elif (reason := _first_match(key, IGNORED)) is not None:
            dropped[f"{key}={value!r}"] = reason
        elif known_key(key):
            problems.append(f"{key}={value!r}: changes what verl computes; ppo-core has no counterpart")
        else:
            problems.append(f"{key}={value!r}: not a key of verl's config; ppo-core has no equivalent")
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # ppo-core path -> the verl key it came from
    mapped: list[str] = []
    for rule in RULES:
        given = reader.given(rule.key)
        if isinstance(user.get(rule.key), Unresolved):
            continue
        value = reader(rule.key)
        try:
            converted = rule.convert(value, reader)
        except (Unsupported, TypeError) as err:  # TypeError: a value of a type the conversion cannot use
            at = getattr(err, "key", None)
            # a value this rule reads is at fault: named once, as itself
            if at is not None and at != rule.key:
                problem = f"{at}={reader(at)!r}: {err}"
                if problem not in problems:
                    problems.append(problem)
            elif given or not isinstance(rule.default, Ref):  # else the key it follows says it
                problems.append(f"{rule.key}={value!r}: {err}")
            continue
        if converted is SKIP:  # nothing to set: say why, for a key the input gives
            means = getattr(rule.convert, "skip_means", "dropped")
            if not given:
                pass
            elif means == "quiet" or at_default(rule.key, value, merged, megatron):
                quiet.append(rule.key)  # a switch that is off, or a default ppo-core's own default matches
            elif means == "mapped":
                mapped.append(rule.key)  # read by the caller (the strategy picks the workers)
            else:
                dropped[f"{rule.key}={value!r}"] = rule.doc or "not read by verl with these settings"
            continue
        if given:
            mapped.append(rule.key)
        emitted = converted.values if isinstance(converted, Emit) else dict.fromkeys(rule.targets, converted)
        for path, item in emitted.items():
            _set(out, path, item)
            source[path] = rule.key
    if problems:
        raise ValueError(
            f"cannot convert {len(problems)} verl config key(s) to ppo-core:\n  "
            + "\n  ".join(sorted(problems))
        )
    conversion = VerlConversion(
        settings=out,
        mapped=tuple(sorted(mapped)),
        quiet=tuple(sorted(quiet)),
        dropped=dict(sorted(dropped.items())),
        strategy=str(reader("actor_rollout_ref.actor.strategy")),
    )
    _check(conversion, source, reader)
    return conversion


def ppo_config_from_verl(cfg: VerlInput, overrides: Sequence[str] = ()) -> PPOConfig:
    """Convert a verl PPO trainer config into a :class:`PPOConfig` with worker dicts for ppo-core's workers.

    The job's inputs (prompt files, model paths) are left out: use :func:`convert_verl` (or
    ``ppo-core convert-verl``) for a runnable job. Arguments and errors as :func:`convert_verl`.

    Returns:
        The config; ``actor.worker`` and ``critic.worker`` hold the worker settings verl has an equivalent for.
    """
    return PPOConfig.from_dict(convert_verl(cfg, overrides).ppo_settings())


class _Reader:
    """The effective value of a verl key: the user's, else verl's default (following verl's interpolations)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def __call__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        default = _RULES[key].default
        return self(default.key) if isinstance(default, Ref) else default

    def given(self, key: str) -> bool:
        return key in self._values


def _copy_tree(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _first_match(key: str, table: tuple[tuple[str, str], ...]) -> str | None:
    """The reason of the first pattern of ``table`` that matches ``key`` (or a section above it), else None."""
    parts = key.split(".")
    return next((reason for pattern, reason in table if _matches(pattern.split("."), parts)), None)


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """Whether ``pattern`` matches a prefix of ``parts`` ("*": one segment, "**": any number of segments)."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and head in ("*", parts[0]) and _matches(rest, parts[1:])


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _check(conversion: VerlConversion, source: dict[str, str], reader: _Reader) -> None:
    """Build the :class:`PPOConfig` and check the worker dicts with the workers' configs; errors name the verl key."""
    from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

    def explain(err: Exception, prefix: str) -> ValueError:
        path = f"{prefix}{err.field}" if isinstance(err, _FieldError) else ""
        key = next((source[p] for p in _ancestors(path) if p in source), None)
        if key is None:
            return ValueError(f"the converted verl config is not valid for ppo-core: {err}{_from_verl(err)}")
        return ValueError(f"verl's {key}={reader(key)!r} is not valid for ppo-core: {err}")

    def _from_verl(err: Exception) -> str:
        """The verl keys behind the ppo-core keys a rule across fields names (a mini-batch that does not divide
        the step's responses...), each with its value and whether it is verl's default."""
        text = str(err)
        named = sorted(
            {source[p] for p in source if re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", text) is not None}
        )
        if not named:
            return ""
        values = [f"{k}={reader(k)!r}{'' if reader.given(k) else ' (verl default)'}" for k in named]
        return "; from verl's " + ", ".join(values)

    try:
        config = PPOConfig.from_dict(conversion.ppo_settings())
    except (TypeError, ValueError) as err:
        raise explain(err, "") from err
    for role, cls in (("actor", TorchActorConfig), ("critic", TorchCriticConfig)):
        worker = getattr(config, role).worker
        if reader(f"{'actor_rollout_ref.actor' if role == 'actor' else 'critic'}.strategy") == "megatron":
            from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig

            cls = MegatronActorConfig if role == "actor" else MegatronCriticConfig
        try:
            cls.from_dict(worker)
        except (TypeError, ValueError) as err:
            raise explain(err, f"{role}.worker.") from err


def _ancestors(path: str) -> list[str]:
    """``a.b[0].c`` -> ``["a.b[0].c", "a.b", "a"]`` (longest first; list indices dropped)."""
    parts = path.replace("[", ".[").split(".")
    names = [p for p in parts if p and not p.startswith("[")]
    return [".".join(names[:i]) for i in range(len(names), 0, -1)]
