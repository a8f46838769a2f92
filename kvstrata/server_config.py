"""``kvstrata serve --config FILE``: every serve setting from a TOML or YAML file, flags overriding it.

Keys are the flags' names without the dashes (``l1_size``, ``chunk_size``, ...), at the top level or in a
``[serve]`` table. An unknown key, or a value of the wrong kind, is an error naming the key and what it
expects, so a typo never starts a server with a default the operator did not mean.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable


class ConfigError(ValueError):
    """The config file cannot be read, or a key in it is unknown or holds a bad value."""


def _size(value: Any) -> int:
    from kvstrata.cli import parse_size

    if isinstance(value, bool):
        raise ValueError("a size (512M, 4G or a byte count)")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except argparse.ArgumentTypeError:
            pass
    raise ValueError("a size (512M, 4G or a byte count)")


def _int(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise ValueError(f"an integer in [{low}, {high if high is not None else 'inf'}]")
        return value
    return check


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError("a number >= 0")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return value
    return check


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("a non-empty string")
    return value


KEYS: dict[str, Callable[[Any], Any]] = {
    "address": _str,
    "l1_size": _size,
    "chunk_size": _int(1),
    "transfer_threads": _int(1),
    "busy_poll_ms": _number,
    "cuda_mode": _choice("staged", "kernel", "torch"),
    "deferred_replies": _bool,
    "allow_remote": _bool,
    "metrics_port": _int(0, 65535),
    "max_message_bytes": _size,
    "curve_secret_key": _str,
    "curve_clients": _str,
    "log_level": _choice("DEBUG", "INFO", "WARNING", "ERROR"),
    "lease_seconds": _number,
    "max_instances_per_connection": _int(1),
    "max_reserved_fraction": _number,
    "max_lock_owners_per_connection": _int(1),
    "max_prompt_tokens": _int(1),
    "max_request_id_bytes": _int(1),
}


def read_config(path: str) -> dict[str, Any]:
    """The file's settings, checked (an error names the file, the key and what was expected)."""
    try:
        text = open(path, "rb").read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    ext = os.path.splitext(path)[1].lower()
    if ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path} is YAML, which needs PyYAML (a kvstrata dependency: pip install pyyaml)") \
                from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    elif ext == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib

        try:
            data = tomllib.loads(text.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    else:
        raise ConfigError(f"{path}: a config file ends in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table of settings")
    if isinstance(data.get("serve"), dict) and len(data) == 1:
        data = data["serve"]
    out = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        check = KEYS.get(norm)
        if check is None:
            raise ConfigError(f"{path}: unknown setting {key!r}; known: {', '.join(KEYS)}")
        try:
            out[norm] = check(value)
        except ValueError as exc:
            raise ConfigError(f"{path}: {key} = {value!r} is not {exc}") from None
    return out


def apply_config_file(args: argparse.Namespace, path: str, *, given: set[str]) -> dict[str, Any]:
    """Set ``args`` from the file for every setting not ``given`` as a flag; returns what the file set."""
    applied = {k: v for k, v in read_config(path).items() if k not in given}
    for key, value in applied.items():
        setattr(args, key, value)
    return applied
