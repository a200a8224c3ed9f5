"""Dict round-tripping for the typed configuration dataclasses (Hydra, OmegaConf and YAML users feed dicts)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

__all__ = ["ConfigBase"]

T = TypeVar("T", bound="ConfigBase")


def _is_config_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, ConfigBase)


def _nested_config_type(tp: Any) -> type | None:
    """The ConfigBase subclass inside ``tp`` (``X`` or ``X | None``), if any."""
    if _is_config_type(tp):
        return tp
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if _is_config_type(arg):
                return arg
    return None


class ConfigBase:
    """Mixin for ``@dataclass(kw_only=True)`` configs: ``to_dict()`` and ``from_dict()`` round-trip exactly.

    ``from_dict`` rejects unknown keys with a ``ValueError`` naming them and the valid ones, and builds nested
    config dataclasses from nested dicts.
    """

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict`` (nested dicts for nested configs) that :meth:`from_dict` turns back into ``self``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, ConfigBase) else value
        return out

    @classmethod
    def from_dict(cls: type[T], data: typing.Mapping[str, Any] | None = None) -> T:
        """Build the config from a mapping; missing keys take their defaults."""
        data = dict(data or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} field(s) {unknown}; valid fields: {', '.join(sorted(fields))}"
            )
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            nested = _nested_config_type(hints.get(name))
            if nested is not None and isinstance(value, typing.Mapping):
                value = nested.from_dict(value)
            kwargs[name] = value
        return cls(**kwargs)
