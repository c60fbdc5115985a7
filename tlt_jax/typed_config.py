"""Typed configuration blocks from plain dicts: frozen dataclasses built field by field, with errors that name the key.

Generic machinery behind :mod:`tlt_jax.config` (kept apart so the run configuration stays readable): an unknown key
lists the valid names, a value of the wrong type names the key, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections

__all__ = ["ConfigError", "as_plain", "build", "coerce", "require"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


def require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}: {msg}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp, key: str) -> Any:
    """``value`` as type ``tp`` (int accepted for float, list for tuple) or a ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"config.{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"config.{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
        elem = args[0] if args else Any
        return tuple(coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    if tp is Any:
        return value
    if tp not in ok:
        raise TypeError(f"config.{key}: unsupported field type {tp}")
    if not ok[tp](value):
        raise ConfigError(f"config.{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return float(value) if tp is float else value


def build(cls, value: Any, key: str):
    if isinstance(value, ml_collections.ConfigDict):
        value = value.to_dict()
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    prefix = f"config.{key}" if key else "config"
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}: expected a block of {cls.__name__} fields, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}: unknown key(s) {unknown} for {cls.__name__}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, v in value.items():
        kwargs[name] = coerce(v, hints[name], f"{key}.{name}" if key else name)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # a block's own __post_init__ (e.g. MeshConfig)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix}: {e}") from e


def as_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
