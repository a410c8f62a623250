"""Megatron-style argparse groups generated from the config dataclasses.

Flag names, types, defaults, choices and help all come from :mod:`megatron_prune.config`; a
field's docstring is its help text. Values are validated by the dataclasses' ``__post_init__``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from typing import Any


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each dataclass field to the string literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, is_list) of an annotation like ``int | None`` or ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_dataclass_group(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one argument group with a flag per field of ``cls`` (dest = field name)."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = flag_of(f)
        help_text = docs.get(f.name, "")
        base, is_list = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        dest = f"{cls.__name__}.{f.name}"
        if base is bool:
            group.add_argument(flag, dest=dest, action="store_true", default=default, help=help_text)
            if "bool_off" in f.metadata:
                group.add_argument(f.metadata["bool_off"], dest=dest, action="store_false", help=f"Turn off {flag}.")
            continue
        kwargs: dict[str, Any] = dict(dest=dest, type=base, default=default, metavar=f.name.upper(),
                                      help=f"{help_text} (default: {default})")
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if is_list:
            kwargs["nargs"] = f.metadata.get("nargs", "+")
        group.add_argument(flag, **kwargs)


def build_parser(prog: str, groups: dict[str, type], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    for title, cls in groups.items():
        add_dataclass_group(parser, cls, title)
    parser.add_argument("--dry-run", action="store_true", help="Validate flags and layout, print the plan, exit.")
    return parser


def configs_from_args(args: argparse.Namespace, groups: dict[str, type]) -> dict[str, Any]:
    """Instantiate each config class from the parsed flags (raising ValueError on bad values)."""
    values = vars(args)
    out = {}
    for cls in groups.values():
        kwargs = {f.name: values[f"{cls.__name__}.{f.name}"] for f in dataclasses.fields(cls)}
        out[cls.__name__] = cls(**kwargs)
    return out


def parse_configs(
    prog: str,
    groups: dict[str, type],
    description: str,
    argv: list[str] | None = None,
    *,
    unknown_handler: Any = None,
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse ``argv`` into config objects; a bad value exits with argparse's usage error.

    ``unknown_handler(unknown_flags)`` may accept flags we do not define (MindSpeed's, on
    Ascend) by returning normally or reject them by raising ValueError; without it unknown
    flags are an error.
    """
    parser = build_parser(prog, groups, description)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if unknown_handler is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        try:
            unknown_handler(unknown)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return args, configs_from_args(args, groups)
    except ValueError as exc:
        from megatron_prune.training.session import fail_usage

        if int(os.environ.get("RANK", "0")) == 0:
            parser.print_usage(sys.stderr)
        fail_usage(exc)  # one message from rank 0, exit code 2
        raise  # unreachable
