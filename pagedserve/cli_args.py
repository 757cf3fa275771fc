"""Config dataclasses <-> command-line flags: one flag per field, so the CLI and the configs cannot drift.

A field's metadata may say how the CLI spells it:
  * "flag": another name for its flag; "aliases": more option strings (vLLM's `-tp`, `-q`);
  * "env": environment variables (first set wins) that default it, which is also how `serve` hands a
    secret to its children without putting it on argv;
  * "json": a list given as one JSON value (`'["a", "b"]'`) or comma-separated, as vLLM's CORS flags;
  * "auto": an `int | None` whose None is spelled `auto` or `-1` (vLLM's --max-model-len).
Every integer flag takes vLLM's sizes: 32k = 32,000, 32K = 32,768.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from common.config import parse_size

Config = TypeVar("Config")


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_or_auto(text: str) -> int | None:
    return None if str(text).strip().lower() in ("auto", "-1") else _size(text)


def json_list(text: str) -> list[str]:
    """'["a", "b"]' or 'a,b'."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def _flag_type(f: dataclasses.Field) -> Callable[[str], Any]:
    t = str(f.type)
    if t.startswith("int"):
        return _size_or_auto if f.metadata.get("auto") else _size
    if t.startswith("float"):
        return float
    return str


def _env_default(f: dataclasses.Field) -> Any:
    names = f.metadata.get("env", ())
    for name in (names,) if isinstance(names, str) else names:
        raw = os.environ.get(name)
        if not raw:
            continue
        if not str(f.type).startswith("list"):
            return raw
        try:
            return json_list(raw) if raw.lstrip().startswith("[") else [raw]
        except argparse.ArgumentTypeError as e:    # before parsing: say which variable, exit 2
            sys.stderr.write(f"pagedserve: error: ${name}: {e}\n")
            raise SystemExit(2) from None
    return _default(f)


def add_config_args(p: argparse.ArgumentParser | Any, config_cls: type, helps: dict[str, str], *,
                    skip: tuple[str, ...] | set[str] = ("model",)) -> None:
    """One flag per field of a config dataclass (see the module docstring). A bool field becomes
    --x/--no-x. `skip`: fields a subcommand spells itself (the positional model) or sets itself."""
    for f in dataclasses.fields(config_cls):
        if f.name in skip:
            continue
        names = (flag_name(f), *f.metadata.get("aliases", ()))
        kw: dict[str, Any] = {"dest": f.name, "default": _env_default(f), "help": helps.get(f.name)}
        if f.type in ("bool", bool):
            p.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif str(f.type).startswith("list[str]") and f.metadata.get("json"):
            p.add_argument(*names, type=json_list, **kw)
        elif str(f.type).startswith("list[str]"):
            p.add_argument(*names, nargs="+", type=str, **kw)
        else:
            p.add_argument(*names, type=_flag_type(f), **kw)


def config_from_args(config_cls: type[Config], args: argparse.Namespace, **overrides: Any) -> Config:
    """The config dataclass from parsed flags (see add_config_args); `overrides` for fields the subcommand
    sets itself rather than from a flag."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if f.name not in overrides}
    return config_cls(**values, **overrides)


def _arg(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def config_flags(config: Any, *, skip: tuple[str, ...] = ("model",)) -> list[str]:
    """The fields of a config dataclass that differ from their defaults, as flags for a child process."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == _default(f):
            continue
        flag = flag_name(f)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, json.dumps(value)] if f.metadata.get("json") else [flag, *map(_arg, value)]
        elif isinstance(value, dict):                 # e.g. LLM(speculative_config={...}): JSON for the child
            out += [flag, json.dumps(value)]
        elif value is None:
            out += [flag, "auto"] if f.metadata.get("auto") else []
        else:
            out += [flag, str(value)]
    return out
