"""``kvstrata serve``'s settings: its flags and its config file, both derived from one declaration.

:class:`ServeSettings` is the server's :class:`~kvstrata.core.server.config.ServerConfig` (per-connection limits
included) plus what only the command uses (how GPU caches are copied, the log level). Each setting is a flag
(``--l1-size``) and a config-file key (``l1_size``, or ``l1-size``), at the top level of a TOML or YAML file or in
its ``[serve]`` table. A flag given on the command line overrides the file, the file overrides the default. An
unknown key, or a value of the wrong kind, is an error naming the key and what it expects, so a typo never
starts a server with a default the operator did not mean.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from kvstrata.core.server.config import Boolean, Choice, Declared, ServerConfig, build, check_value, declared, \
    group, setting

CUDA_MODES = ("staged", "torch")
"""The modes of :data:`kvstrata.native.cuda_executor.MODES` a server may be started with, named here so that building
the command line does not import torch (a test checks they are the executor's). The executor's ``kernel`` mode is
not one: it was slower on first-token time (docs/decisions.md) and stays a parameter of the GPU tests."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """The config file cannot be read, or a key in it is unknown or holds a bad value."""


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``kvstrata serve`` takes (except ``--config``, the file that sets the rest)."""

    server: ServerConfig = group(ServerConfig)
    cuda_mode: str = setting("staged", Choice(*CUDA_MODES), "how GPU caches are copied (see "
                             "kvstrata.native.cuda_executor)", benchmark=True)
    log_level: str = setting("INFO", Choice(*LOG_LEVELS), "start-up logs the effective configuration")


def _flag_type(item: Declared) -> Any:
    def parse(text: str) -> Any:
        try:
            return item.kind.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not {exc}") from None
    parse.__name__ = item.key
    return parse


def help_of(item: Declared) -> str:
    """A setting's help as ``--help`` shows it: its own, its default, and whether it is a benchmark parameter."""
    text = f"{item.help} (default {item.default_text})"
    if isinstance(item.kind, Boolean) and item.default:
        text = f"turns {item.key} off: {text}"
    if item.benchmark:
        text += "; a benchmark parameter, for A/B measurements, not a deployment setting"
    return text.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting of :class:`ServeSettings`. A flag not given leaves no attribute on the parsed
    namespace (``argparse.SUPPRESS``), so :func:`settings_from` tells the given flags from the defaults."""
    for item in declared(ServeSettings):
        if isinstance(item.kind, Boolean):
            if item.default:
                parser.add_argument("--no-" + item.flag[2:], dest=item.key, action="store_false",
                                    default=argparse.SUPPRESS, help=help_of(item))
            else:
                parser.add_argument(item.flag, dest=item.key, action="store_true", default=argparse.SUPPRESS,
                                    help=help_of(item))
            continue
        parser.add_argument(item.flag, dest=item.key, type=_flag_type(item), default=argparse.SUPPRESS,
                            choices=item.kind.choices, metavar=item.kind.metavar, help=help_of(item))


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags on the command line, by key (already checked by their types)."""
    keys = {item.key for item in declared(ServeSettings)}
    return {k: v for k, v in vars(args).items() if k in keys}


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The effective settings: the defaults, overridden by ``args.config``'s file if given, overridden by the
    flags given. ConfigError names the file and the key where one is bad."""
    values = read_config(args.config) if getattr(args, "config", None) else {}
    values.update(flag_values(args))
    try:
        return build(ServeSettings, values)
    except ValueError as exc:  # a combination no single key's check refuses
        raise ConfigError(str(exc)) from None


def read_config(path: str) -> dict[str, Any]:
    """The file's settings by key, each checked and normalised (sizes in bytes); an error names the file, the
    key and what was expected."""
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
    items = {item.key: item for item in declared(ServeSettings)}
    out = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        item = items.get(norm)
        if item is None:
            raise ConfigError(f"{path}: unknown setting {key!r}; known: {', '.join(items)}")
        try:
            out[norm] = check_value(item, value)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return out
