"""Command-line flags generated from config dataclasses: a field with `metadata={"help": ...}` is a
flag, and its default, or `MATINEE_<FLAG>` from the environment, is the flag's default.
Only fields that say so become flags: a secret never gets that metadata.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, Field, fields
from typing import Any, Mapping

ENV_PREFIX = "MATINEE_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MB', '2g' -> bytes (binary units, as memory budgets are)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 536870912)")
    unit = (m.group(2) or "b").lower()[0]
    return int(float(m.group(1)) * {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def int_or_none(text: str) -> int | None:
    if text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected an integer or "none", got {text!r}') from None


# A field names its parser in metadata["type"] (by name, so the config classes import nothing from
# here); without one the annotation decides.
PARSERS = {"bytes": parse_bytes, "int_or_none": int_or_none, "int": int, "float": float, "str": str}


def flag_fields(cls: type) -> list[Field]:
    return [f for f in fields(cls) if "help" in f.metadata]


def flag_name(f: Field) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def dest(f: Field) -> str:
    return flag_name(f)[2:].replace("-", "_")


def default(f: Field) -> Any:
    if f.default is MISSING and f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _type(f: Field) -> str:
    """'int', 'str', 'bool', ...: the annotation, a string where the module postpones them."""
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return name.removesuffix(" | None")


def _negated(f: Field) -> bool:
    # A bool that is on by default is turned off by its flag (--no-prefix-caching).
    return _type(f) == "bool" and f.default is True


def _parser(f: Field):
    if "nargs" in f.metadata:   # a list of values: each one parsed by metadata["type"], str by default
        return PARSERS[f.metadata.get("type", "str")]
    return PARSERS[f.metadata.get("type", _type(f))]


class _Many(argparse.Action):
    """`--flag A B --flag C` -> [A, B, C]; the first use on the command line replaces the default
    (which may have come from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, self.dest)
        items = [] if items is self.default or items is None else items
        setattr(namespace, self.dest, items + list(values))


def _from_env(f: Field, environ: Mapping[str, str]) -> Any:
    """The flag's default: MATINEE_<DEST> if set (an empty value counts as unset, so compose files
    may pass `${VAR:-}` through), else the field's own."""
    name = ENV_PREFIX + dest(f).upper()
    raw = environ.get(name, "")
    if raw == "":
        return False if _type(f) == "bool" else default(f)
    if _type(f) == "bool":
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        if "nargs" in f.metadata:   # several values, separated by spaces
            return [_parser(f)(v) for v in raw.split()]
        value = _parser(f)(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {list(choices)}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except a secret's (`metadata["secret"]`): that default may come
    from the environment, and --help output ends up in terminals, logs and bug reports."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if getattr(action, "secret", False):
            return action.help
        return super()._get_help_string(action)


def add_flags(group, cls: type, environ: Mapping[str, str] | None = None) -> None:
    """One flag per help-carrying field of `cls`, on a parser or an argument group."""
    environ = os.environ if environ is None else environ
    for f in flag_fields(cls):
        if _type(f) == "bool":
            action = group.add_argument(flag_name(f), action="store_true", default=_from_env(f, environ),
                                        help=f.metadata["help"])
        elif "nargs" in f.metadata:
            action = group.add_argument(flag_name(f), type=_parser(f), default=_from_env(f, environ),
                                        nargs=f.metadata["nargs"], action=_Many, help=f.metadata["help"],
                                        metavar=f.metadata.get("metavar"))
        else:
            action = group.add_argument(flag_name(f), type=_parser(f), default=_from_env(f, environ),
                                        choices=f.metadata.get("choices"), help=f.metadata["help"])
        action.secret = f.metadata.get("secret", False)


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flag fields of `cls` from parsed flags, by field name."""
    out = {}
    for f in flag_fields(cls):
        value = getattr(args, dest(f))
        out[f.name] = not value if _negated(f) else value
    return out


def build(cls: type, args: argparse.Namespace, **others: Any):
    """`cls` from its flags, and `others` for the fields that are not flags."""
    return cls(**values(cls, args), **others)
