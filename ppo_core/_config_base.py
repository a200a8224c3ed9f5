"""``ConfigBase``: dict round-tripping and type checking of every field for the typed configuration dataclasses.

Hydra, OmegaConf and YAML users feed plain (or OmegaConf) mappings, where ``"false"`` is a truthy string and
``"0"`` is not a seed. So every field is checked against its annotation when a config is constructed, by one
generic mechanism (no hand-written type checks per field):

=============================== ==================================================================================
annotation                      accepts (and stores)
=============================== ==================================================================================
``bool``                        ``True`` / ``False`` only (not ``"false"``, not ``0``)
``int``                         integers, numpy ones included (not bools, floats or strings); stored as ``int``
``float``                       real numbers and ints (not bools or strings); stored as ``float``
``str``                         strings and ``os.PathLike`` paths; stored as ``str``
``Literal["a", "b"]``           one of the listed values (``ValueError`` listing them otherwise)
``X | None``                    ``None`` or what ``X`` accepts
``tuple[X, ...]``, ``list[X]``  lists and tuples (any non-string sequence) of what ``X`` accepts
``tuple[X, Y]``                 a sequence of exactly two items
``dict[str, X]``                mappings with ``str`` keys; ``dict[str, Any]`` values become plain dicts/lists
a ``ConfigBase`` subclass       an instance, or a mapping given to its :meth:`ConfigBase.from_dict`
``ConfigBase`` itself           an instance of any config class
``Any``                         anything
=============================== ==================================================================================

Errors are ``TypeError`` (wrong type) or ``ValueError`` (value not allowed) whose message starts with the field's
path: a nested config re-raises the errors of its sections under a dotted path (``trainer.seed must be an int,
got str '0'``), including the range checks that a config's own ``__post_init__`` makes after the type check.
The annotations of a class are resolved once and cached, so constructing a config costs one cheap call per field.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ppo_core._checks import FieldTypeError, FieldValueError, _FieldError, check_int, describe

__all__ = ["ConfigBase"]

T = TypeVar("T", bound="ConfigBase")

# A checker validates one value at a path (the field name, or ``name[i]`` / ``name['key']`` inside it) and returns
# it normalised (int -> float for a float field, list -> tuple, mapping -> config...).
_Checker = Callable[[Any, str], Any]

_CHECKERS: dict[type, tuple[tuple[str, _Checker], ...]] = {}


def _type_error(path: str, expected: str, value: object) -> FieldTypeError:
    return FieldTypeError(path, f" must be {expected}, got {describe(value)}")


def _nested(section: str, build: Callable[[], Any], fields: Sequence[str] = ()) -> Any:
    """Run ``build`` (the construction of a nested config); re-raise its errors under ``section``.

    ``fields``: the config's field names, for checks written by others (a registered engine's ``__post_init__``
    raising a plain ``ValueError("gpu_memory_utilization must be ...")``): a message that starts with one of them
    is re-raised under ``section.<field>``, as the library's own field checks are.
    """
    try:
        return build()
    except _FieldError as err:
        raise err.within(section).with_traceback(err.__traceback__) from None
    except (TypeError, ValueError) as err:  # a hand-written check that names several fields, or none
        cls = FieldTypeError if isinstance(err, TypeError) else FieldValueError
        text = str(err)
        named = [f for f in fields if text.startswith(f"{f} ")]
        if named:
            field = max(named, key=len)
            raise cls(f"{section}.{field}", text[len(field) :]).with_traceback(err.__traceback__) from None
        raise cls(section, f": {err}").with_traceback(err.__traceback__) from None


def _plain(value: Any) -> Any:
    """Mappings and non-string sequences of other kinds (OmegaConf containers) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _as_plain(value: Any) -> Any:
    """``value`` with every config inside it (a field, a dict value, a list item) as its :meth:`to_dict`."""
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _as_plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_as_plain(v) for v in value)
    if isinstance(value, list):
        return [_as_plain(v) for v in value]
    return value


def _check_any(value: Any, path: str) -> Any:
    return _plain(value)


def _check_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):  # a YAML string such as "false" would otherwise be truthy
        raise _type_error(path, "a bool", value)
    return value


def _check_int(value: Any, path: str) -> int:
    return check_int(path, value)


def _check_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(path, "a float", value)
    return float(value)


def _check_str(value: Any, path: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _type_error(path, "a str", value)
    return value


def _check_none(value: Any, path: str) -> None:
    if value is not None:
        raise _type_error(path, "None", value)
    return None


def _describe_type(tp: Any) -> str:
    """How an annotation reads in an error message: ``an int``, ``a str or None``, ``a KLConfig or a dict``."""
    if tp is type(None):
        return "None"
    if tp is int:
        return "an int"
    if tp in (bool, float, str):
        return f"a {tp.__name__}"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # "a dict or a X" (not "a dict or a X or a dict")
        parts = [part for arg in typing.get_args(tp) for part in _describe_type(arg).split(" or ")]
        return " or ".join(dict.fromkeys(parts))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in typing.get_args(tp))
    if origin in (tuple, list):
        return "a list or tuple"
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "a dict"
    if tp is ConfigBase:
        return "a config"
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        return f"a {tp.__name__} or a dict"
    return f"a {getattr(tp, '__name__', repr(tp))}"


def _compile(tp: Any, where: str) -> _Checker:
    """The checker of annotation ``tp``; ``where`` (``Class.field``) names an unsupported annotation."""
    simple = {
        bool: _check_bool,
        int: _check_int,
        float: _check_float,
        str: _check_str,
        type(None): _check_none,
    }
    if tp is Any or tp is object:
        return _check_any
    if tp in simple:
        return simple[tp]
    if tp is ConfigBase:  # any config instance (the base itself builds nothing from a mapping)
        return _instance_checker(ConfigBase)
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        return _config_checker(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return _literal_checker(args)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(tp, [_compile(arg, where) for arg in args], type(None) in args)
    if origin is tuple or origin is list:
        return _sequence_checker(tp, origin, args, where)
    if origin is dict or origin is Mapping or tp in (dict, Mapping):
        return _dict_checker(args, where)
    if isinstance(tp, type) and origin is None:
        return _instance_checker(tp)
    raise TypeError(f"{where}: annotation {tp!r} is not supported by ConfigBase's type check")


def _config_checker(cls: type[ConfigBase]) -> _Checker:
    def check(value: Any, path: str) -> Any:
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return _nested(path, lambda: cls.from_dict(value))
        raise _type_error(path, f"a {cls.__name__} or a dict", value)

    return check


def _literal_checker(choices: tuple[Any, ...]) -> _Checker:
    def check(value: Any, path: str) -> Any:
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return value
        if all(isinstance(c, str) for c in choices) and isinstance(value, str):
            valid = ", ".join(sorted(choices))
            raise FieldValueError(path, f" {value!r}; valid values: {valid}", before="unknown ")
        raise _type_error(path, "one of " + ", ".join(repr(c) for c in choices), value)

    return check


def _union_checker(tp: Any, checkers: list[_Checker], allows_none: bool) -> _Checker:
    expected = _describe_type(tp)

    def check(value: Any, path: str) -> Any:
        if value is None and allows_none:
            return None
        failure: _FieldError | None = None
        for checker in checkers:
            try:
                return checker(value, path)
            except _FieldError as err:
                # an error inside the value (a nested field, a list item) is more precise than "must be X or Y"
                if err.field != path or not isinstance(err, TypeError):
                    failure = err
        if failure is not None:
            raise failure
        raise _type_error(path, expected, value)

    return check


def _sequence_checker(tp: Any, origin: type, args: tuple[Any, ...], where: str) -> _Checker:
    variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
    items = [_compile(args[0] if args else Any, where)] if variadic else [_compile(a, where) for a in args]

    def check(value: Any, path: str) -> Any:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise _type_error(path, "a list or tuple", value)
        if not variadic and len(value) != len(items):
            raise _type_error(path, f"a list or tuple of {len(items)} items", value)
        checkers = items * len(value) if variadic else items
        out = [checker(v, f"{path}[{i}]") for i, (checker, v) in enumerate(zip(checkers, value, strict=True))]
        return origin(out)

    return check


def _dict_checker(args: tuple[Any, ...], where: str) -> _Checker:
    key_check = _compile(args[0], where) if args else _check_any
    value_check = _compile(args[1], where) if args else _check_any

    def check(value: Any, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise _type_error(path, "a dict", value)
        out = {}
        for key, item in value.items():
            try:
                key_check(key, path)
            except _FieldError:
                raise FieldTypeError(path, f" keys must be str, got {describe(key)}") from None
            out[key] = value_check(item, f"{path}[{key!r}]")
        return out

    return check


def _instance_checker(cls: type) -> _Checker:
    def check(value: Any, path: str) -> Any:
        if not isinstance(value, cls):
            raise _type_error(path, f"a {cls.__name__}", value)
        return value

    return check


def _field_checkers(cls: type) -> tuple[tuple[str, _Checker], ...]:
    """``(field name, checker)`` for every init field of dataclass ``cls``, built on first use and cached."""
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        hints = typing.get_type_hints(cls)
        checkers = tuple(
            (f.name, _compile(hints[f.name], f"{cls.__name__}.{f.name}"))
            for f in dataclasses.fields(cls)
            if f.init
        )
        _CHECKERS[cls] = checkers
    return checkers


def _check_fields(self: ConfigBase) -> None:
    for name, checker in _field_checkers(type(self)):
        value = getattr(self, name)
        checked = checker(value, name)
        if checked is not value:
            object.__setattr__(self, name, checked)  # also for frozen dataclasses


def _checking(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    """Wrap a class's own ``__post_init__`` so that the field types are checked before its range checks."""

    @functools.wraps(post_init)
    def __post_init__(self: ConfigBase) -> None:
        # only the outermost call checks: a subclass's __post_init__ may call super().__post_init__()
        if type(self).__post_init__ is __post_init__:
            _check_fields(self)
        post_init(self)

    __post_init__._checks_fields = True  # type: ignore[attr-defined]
    return __post_init__


class ConfigBase:
    """Mixin for ``@dataclass(kw_only=True)`` configs: type-checked fields, exact ``to_dict``/``from_dict``.

    Every field is checked against its annotation when the config is constructed (see the module docstring),
    before the class's own ``__post_init__`` (which then only checks ranges and relations between fields).
    ``from_dict`` rejects unknown keys with a ``ValueError`` naming them and the valid ones, and builds nested
    config dataclasses from nested mappings; errors inside a section carry its dotted path.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_checks_fields", False):
            cls.__post_init__ = _checking(own)  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        _check_fields(self)

    __post_init__._checks_fields = True  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict`` (nested dicts for nested configs) that :meth:`from_dict` turns back into ``self``."""
        return {f.name: _as_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def coerce(cls: type[T], config: object, *, none_is_default: bool = False, what: str = "config") -> T:
        """``config`` as a ``cls``: an instance as it is, a mapping through :meth:`from_dict`, and ``None`` as the
        defaults when ``none_is_default``; anything else raises ``TypeError`` naming ``what`` and the class (the
        one check behind the functions and workers that take "a config or a dict of its fields").

        Example:
            >>> from ppo_core.rollout_correction import RolloutCorrectionConfig
            >>> RolloutCorrectionConfig.coerce({"rollout_is": "token"}).rollout_is
            'token'
        """
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping) or (config is None and none_is_default):
            return cls.from_dict(config)  # type: ignore[arg-type]
        raise TypeError(f"{what} must be a {cls.__name__} or a dict, got {describe(config)}")

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any] | None = None) -> T:
        """Build the config from a mapping (a dict, an OmegaConf ``DictConfig``...); missing keys take defaults."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {describe(data)}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        unknown = sorted((k for k in data if k not in fields), key=str)
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} field(s) {unknown}; valid fields: {', '.join(sorted(fields))}"
            )
        missing = [
            name
            for name, f in fields.items()
            if name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise FieldTypeError(
                missing[0], f" is required ({cls.__name__} has no default for {', '.join(missing)})"
            )
        return cls(**data)
