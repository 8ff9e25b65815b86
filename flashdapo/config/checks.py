"""Declarative checks of the config tree.

A field states what it accepts in its type: `Annotated[int, ge(1)]`, `Annotated[float, within(0, 1)]`, an
upper bound where a huge value would take the machine (`at_most(1024, why)`), `IS_PATH` for a path (`~`
expanded when the section is built); the type itself is checked strictly (a bool is a bool, an int an int,
a float a finite number). A section states checks between its fields as `RULES`. One walker,
`check_section`, runs all of them when a section is built and names each failing field by its path in the
tree (`optim.lr`), which is derived from where the section sits under the root (`register_tree`), never
retyped.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import operator
import os
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from ..errors import ConfigError


@dataclass(frozen=True)
class Check:
    """A constraint on one field's value: `test(value)` holds; `expected` says what is allowed."""

    test: Callable[[Any], bool]
    expected: str


def ge(low: float) -> Check:
    """value >= low."""
    return Check(lambda v: v >= low, f">= {low}")


def gt(low: float) -> Check:
    """value > low."""
    return Check(lambda v: v > low, f"> {low}")


def within(low: float, high: float, bounds: str = "[]") -> Check:
    """low <= value <= high; `bounds` is "[]", "[)", "(]" or "()" as in interval notation."""
    low_ok = operator.le if bounds[0] == "[" else operator.lt
    high_ok = operator.le if bounds[1] == "]" else operator.lt
    return Check(lambda v: low_ok(low, v) and high_ok(v, high),
                 f"a value in {bounds[0]}{low}, {high}{bounds[1]}")


def at_most(high: int | float, why: str) -> Check:
    """value <= high: the upper bound of a setting whose huge value would take the machine (allocate or loop
    without end); `why` says so in the refusal (`rollout.agree_every: expected at most 1,024 (...), got
    ...`)."""
    shown = f"{high:,}" if isinstance(high, int) else f"{high:,g}"
    return Check(lambda v: v <= high, f"at most {shown} ({why})")


TOKENS_MAX = 1 << 20
"""The most tokens of a prompt or a response (1,048,576): beyond any model's positions."""
TOKENS_WHY = "1M tokens, beyond any model's positions"
BATCH_MAX = 1 << 16
"""The most prompts of a batch, sequences of a decode batch or samples of a probe (65,536): the released
recipe samples 1,536 prompts a round."""
BATCH_WHY = "held in memory at once"
SEED_MAX = at_most(2**32 - 1, "seeds are 32-bit")
"""The range of a seed (derived seeds pack it as a signed 64-bit integer with the step and rank added)."""
TIMEOUT_MAX_S = 7 * 24 * 3600
"""The longest timeout, a week: the process group's timeout must fit its clock's integer milliseconds."""


@dataclass(frozen=True)
class PathMarker:
    """Marks a field (`Annotated[str, IS_PATH]`, or a list of them) as a filesystem path: building its section
    expands a leading `~` (os.path.expanduser) before the checks, whether the value came from the command
    line, a config file or code."""


IS_PATH = PathMarker()


def is_path_field(cls: type, name: str) -> bool:
    """Whether field `name` of section `cls` is marked IS_PATH."""
    tp = _hints(cls)[name]
    return typing.get_origin(tp) is Annotated and any(
        isinstance(m, PathMarker) for m in typing.get_args(tp)[1:])


def expand_paths(section: Any) -> None:
    """Expand `~` in every IS_PATH field of `section` (a string, or a list of strings), in place."""
    for f in dataclasses.fields(section):
        if not is_path_field(type(section), f.name):
            continue
        value = getattr(section, f.name)
        if isinstance(value, str):
            setattr(section, f.name, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(section, f.name, [os.path.expanduser(v) if isinstance(v, str) else v for v in value])


# Shorthands of the section modules' field types.
Positive = Annotated[int, ge(1)]
NonNegative = Annotated[int, ge(0)]
PositiveFloat = Annotated[float, gt(0)]
Fraction = Annotated[float, within(0, 1)]
PathStr = Annotated[str, IS_PATH]
"""A filesystem path (`~` expanded)."""


@dataclass(frozen=True)
class Rule:
    """A constraint between fields of one section, reported at `field` (a dotted path inside the section)."""

    field: str
    test: Callable[[Any], bool]
    expected: Callable[[Any], str]
    """What is allowed, given the section (it may quote another field's value)."""


_PATHS: dict[type, str] = {}


def register_tree(root: type, prefix: str = "") -> None:
    """Record the path of every section under `root` (each section class sits at one place in the tree);
    `prefix` names the root's own fields (e.g. "eval." for the options of `flashdapo eval`)."""
    _PATHS[root] = prefix
    for f in dataclasses.fields(root):
        sub = section_type(root, f.name)
        if sub is not None:
            register_tree(sub, f"{prefix}{f.name}.")


def field_path(cls: type, name: str) -> str:
    """The dotted path of field `name` of section `cls` in the tree (`ToyTaskConfig`, 'seed' ->
    'data.toy.seed')."""
    return _PATHS.get(cls, "") + name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def field_spec(cls: type, name: str) -> tuple[Any, tuple[Check, ...]]:
    """(type without Annotated, the field's checks)."""
    tp = _hints(cls)[name]
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(m for m in meta if isinstance(m, Check))
    return tp, ()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of section `cls` (the help tyro shows for it)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and
                isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def section_type(cls: type, name: str) -> type | None:
    """The dataclass type of field `name` when it is a sub-section, else None."""
    tp, _ = field_spec(cls, name)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def optional_inner(tp: Any) -> Any | None:
    """T for `T | None`, else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_mismatch(value: Any, tp: Any) -> str | None:
    """What `tp` expects, when `value` is not of it; None when it is. Strict: a bool is no int, a string
    no bool, a float must be finite."""
    inner = optional_inner(tp)
    if inner is not None:
        return None if value is None else (f"null or {wanted}" if
                                           (wanted := type_mismatch(value, inner)) else None)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return None if isinstance(value, bool) else "true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    if origin is Literal:
        ok = any(value == a and type(value) is type(a) for a in args)
        return None if ok else "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        ok = isinstance(value, list) and all(type_mismatch(v, args[0]) is None for v in value)
        return None if ok else f"a list of {_plural(args[0])}"
    if origin is tuple:
        ok = isinstance(value, tuple) and len(value) == len(args) and all(
            type_mismatch(v, a) is None for v, a in zip(value, args, strict=False))
        return None if ok else f"a list of {len(args)} {_plural(args[0])}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return None if isinstance(value, tp) else "a mapping (a config section)"
    raise TypeError(f"config checks: unsupported field type {tp!r}")


def _plural(tp: Any) -> str:
    return {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}.get(tp, repr(tp))


def check_section(section: Any) -> None:
    """Check every leaf field of `section` (type, then constraints) and the section's RULES; sub-sections
    checked themselves when they were built. Raises ConfigError naming the field's path."""
    cls = type(section)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        tp, checks = field_spec(cls, f.name)
        wanted = type_mismatch(value, tp)
        if wanted is None and value is not None:
            failed = [c.expected for c in checks if not c.test(value)]
            optional = "null or " if optional_inner(tp) is not None else ""
            wanted = optional + " and ".join(failed) if failed else None
        if wanted is not None:
            raise ConfigError(f"{field_path(cls, f.name)}: expected {wanted}, got {_show(value)}")
    for rule in getattr(cls, "RULES", ()):
        if not rule.test(section):
            raise ConfigError(f"{field_path(cls, rule.field)}: expected {rule.expected(section)}, "
                              f"got {_show(operator.attrgetter(rule.field)(section))}")


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if dataclasses.is_dataclass(value):
        return type(value).__name__
    return repr(value)


class Section:
    """Base of the config sections: building one checks it (see `check_section`)."""

    RULES: ClassVar[tuple[Rule, ...]] = ()

    def __post_init__(self) -> None:
        expand_paths(self)
        check_section(self)
