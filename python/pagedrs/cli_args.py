"""Command-line flags derived from a config dataclass whose fields are `pagedrs.config.knob`s.

- A field ``max_num_seqs`` is the flag ``--max-num-seqs`` (plus the knob's extra ``flags``),
  with the field's default and help; ``Literal`` values become ``choices``; a bool is a
  ``--x / --no-x`` pair; a ``list`` takes one or more values; a ``positional`` knob is a
  positional argument.
- `config_from_args` builds the dataclass back from the parsed namespace, so a value takes
  one trip: flag -> field -> its validation (a bad value is a usage error, not a traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")

GROUP_TITLES = {
    "server": ("server", None),
    "engine": ("engine", None),
    "tools": ("tools and reasoning", None),
    "parallel": (
        "tensor parallelism",
        "N ranks, one process each; on several machines every node runs the same command with its own "
        "--node-rank (node 0 serves; the others are headless), or torchrun starts the ranks",
    ),
    "data_parallel": (
        "data parallelism",
        "N engine replicas, one process each (each may be tensor-parallel), behind the pagedrs-router front",
    ),
}


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type) -> argparse.ArgumentParser:
    """Adds one argument per field of ``config_class`` (in field order), in the argument
    groups its knobs name."""
    hints = typing.get_type_hints(config_class, include_extras=False, localns=_type_names())
    groups: dict[str, Any] = {}
    for spec in dataclasses.fields(config_class):
        meta = spec.metadata
        if "help" not in meta:
            continue
        group_name = meta.get("group")
        target: Any = parser
        if group_name is not None:
            if group_name not in groups:
                title, description = GROUP_TITLES.get(group_name, (group_name, None))
                groups[group_name] = parser.add_argument_group(title, description)
            target = groups[group_name]
        kind, choices = _flag_kind(hints[spec.name])
        choices = list(meta["choices"]) if meta.get("choices") else choices
        default = spec.default if spec.default is not dataclasses.MISSING else None
        help_text = meta["help"]
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        options: dict[str, Any] = {"default": default, "help": help_text}
        if meta.get("positional"):
            target.add_argument(spec.name, nargs="?", **options)
            continue
        names = [*meta.get("flags", ()), "--" + spec.name.replace("_", "-")]
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif _is_list(hints[spec.name]):  # one or more values after the flag
            options["nargs"] = "+"
        else:
            options["type"] = kind
            if choices:
                options["choices"] = choices
        target.add_argument(*names, dest=spec.name, **options)
    return parser


def config_from_args(config_class: type[T], args: argparse.Namespace) -> T:
    """The ``config_class`` instance the parsed flags describe."""
    specs = dataclasses.fields(config_class)  # type: ignore[arg-type]  # any dataclass
    values = {spec.name: getattr(args, spec.name) for spec in specs if spec.init}
    return config_class(**values)


def flags_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """The command line that parses (with ``parser``) to ``args``, less the ``skip`` settings
    and those left at their default: how a process passes its flags on to another."""
    argv: list[str] = []
    for action in parser._actions:
        if action.dest in skip or not hasattr(args, action.dest) or isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if not action.option_strings:  # positional
            argv[:0] = [str(value)]
        elif isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0]  # --name; the second is --no-name
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [action.option_strings[-1], *map(str, value)]
        else:
            argv += [action.option_strings[-1], str(value)]
    return argv


def _is_list(hint: Any) -> bool:
    return list in (get_args(hint) or (hint,))


def _flag_kind(hint: Any) -> tuple[Any, list[str] | None]:
    """``(argparse type, choices)`` of a field type; ``None`` drops out of unions and a type
    the command line cannot spell (a ``torch.dtype``, a parsed config) reads as text."""
    members = get_args(hint) if get_origin(hint) is not Literal and get_args(hint) else (hint,)
    options = [option for option in members if option is not type(None)]
    for option in options:
        if get_origin(option) is Literal:
            return str, list(get_args(option))
    for kind in (bool, int, float):
        if options == [kind] or (kind is not bool and kind in options and str not in options):
            return kind, None
    return str, None


class _TorchNames:
    """Stands for torch in the annotations (``torch.dtype``): the command line spells a dtype
    as text, and parsing flags should not import torch."""

    dtype = str


def _type_names() -> dict[str, Any]:
    """Names the config modules' annotations use only under ``TYPE_CHECKING``."""
    return {"torch": _TorchNames}
