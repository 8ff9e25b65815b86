"""The one command-line parser of every flashdapo command (train, config, plan, eval, generate, ablate).

Each command describes its options as a dataclass (the config tree, AblateOptions, PlanOptions, eval's and
generate's argument classes) and reads them with `parse`, which tyro drives with one set of rules, so every
command reads a value the same way:

- a bool takes a value: `true`/`false` as the docs and YAML write them, `True`/`False` as Python does, or
  `1`/`0` (`CLI_REGISTRY`); a command's few switches may also stand alone (`--quick` is `--quick true`,
  `--no-progress` is `--progress false`);
- a value the parser cannot read (`maybe` for a bool, `abc` for an int), an unknown option or a missing one
  is one line, `flashdapo CMD: error: ...`, and exit status 2; a value of the right type that a field's
  checks refuse is a ConfigError naming the field (config/checks.py).

tyro is imported here and nowhere else at import time: only the command line needs it (the GPU machines'
image has no tyro), so `import flashdapo.config` does not import this module.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, TypeVar

import tyro

from .checks import Check, PathMarker
from .presets import DEFAULT_PRESET, PRESETS, starting_point
from .tree import Config

try:  # tyro's hook on a refused command line (a private module of tyro 1.x); without it, tyro's own box
    from tyro._errors import on_parse_error as _on_parse_error
except ImportError:  # pragma: no cover
    _on_parse_error = None

T = TypeVar("T")

BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}
"""What the command line accepts for a bool field (case-insensitive): the docs write `true`/`false`."""
_BOOL_CHOICES = tuple(dict.fromkeys(w for word in BOOL_WORDS
                                    for w in (word, word.capitalize(), word.upper())))

CLI_REGISTRY = tyro.constructors.ConstructorRegistry()
"""tyro's rules for every flashdapo command line (`parse`)."""


@CLI_REGISTRY.primitive_rule
def _bool_rule(
        type_info: tyro.constructors.PrimitiveTypeInfo) -> tyro.constructors.PrimitiveConstructorSpec | None:
    """A bool field takes one of BOOL_WORDS (any case) as its value, as a config file does."""
    if type_info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="{true,false}", instance_from_str=lambda args: BOOL_WORDS[args[0].lower()],
        choices=_BOOL_CHOICES, is_instance=lambda x: isinstance(x, bool),
        str_from_instance=lambda instance: [str(instance).lower()])


def _number(tp: type, words: str) -> tyro.constructors.PrimitiveConstructorSpec:
    """An int or a float read by Python's own reading of it, refused as the config checks word it."""

    def read(args: list[str]) -> Any:
        try:
            return tp(args[0])
        except ValueError:
            raise ValueError(f"expected {words}, got {args[0]!r}") from None

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar=tp.__name__.upper(), instance_from_str=read,
        is_instance=lambda x: isinstance(x, (int, tp)) and not isinstance(x, bool),
        str_from_instance=lambda instance: [str(instance)])


@CLI_REGISTRY.primitive_rule
def _number_rule(
        type_info: tyro.constructors.PrimitiveTypeInfo) -> tyro.constructors.PrimitiveConstructorSpec | None:
    """`abc` for an int or a float field: `expected an integer, got 'abc'` (`inf` is a float: its field's
    checks refuse it, naming the field)."""
    words = {int: "an integer", float: "a number"}.get(type_info.type)
    return None if words is None else _number(type_info.type, words)


def option(tp: Any, help_text: str, *checks: Check | PathMarker) -> Any:
    """`tp` with its checks (and IS_PATH for a path) and the help `--help` shows for it: the type of an option
    built at run time (eval's and generate's argument classes), whose help is not a field docstring."""
    return Annotated[(tp, *checks, tyro.conf.arg(help=help_text))]


def with_switch_values(argv: Sequence[str], switches: Sequence[str]) -> list[str]:
    """argv with the value of each switch written out: a switch given alone (last, or before another option)
    is true, `--no-NAME` is `--NAME false`. Every other bool takes its value."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        following = argv[i + 1] if i + 1 < len(argv) else "-"
        if arg in switches and following.startswith("-"):
            out += [arg, "true"]
        elif arg.startswith("--no-") and "--" + arg[len("--no-"):] in switches:
            out += ["--" + arg[len("--no-"):], "false"]
        else:
            out.append(arg)
    return out


def parse(cls: type[T], argv: Sequence[str], *, prog: str, description: str | None = None,
          default: T | None = None, known_only: bool = False, switches: Sequence[str] = ()) -> Any:
    """Read `cls` (a dataclass; its fields are the options `--FIELD` / `--SECTION.FIELD`) from `argv`:
    the instance, or with `known_only` (instance, the arguments that are none of its options). `default`: the
    instance whose values are the defaults (else the fields' own); `switches`: bool options that may stand
    alone (`with_switch_values`). `--help` prints the help and exits 0; an argument the parser cannot read is
    one line on stderr and exit status 2 (SystemExit)."""
    defaults = {} if default is None else {"default": default}
    try:
        with _one_line_errors():
            return tyro.cli(cls, args=with_switch_values(list(argv), switches), prog=prog,
                            description=description, return_unknown_args=known_only,
                            config=(tyro.conf.FlagConversionOff, ), registry=CLI_REGISTRY, **defaults)
    except _Refused as refused:
        print(f"{prog}: error: {refused}; see {prog} --help", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def resolve_config(argv: Sequence[str], prog: str) -> Config:
    """Preset, then config file, then command-line overrides -> a validated Config (`flashdapo train`)."""
    base, rest, start = starting_point(list(argv), DEFAULT_PRESET)
    description = (
        f"{Config.__doc__}\n\nStarting point: {start} (presets: {', '.join(PRESETS)}; --preset NAME, "
        "--config FILE). Defaults below are that start.")
    return parse(Config, rest, prog=prog, description=description, default=base)


class _Refused(Exception):
    """The command line was refused; the message is its one line."""


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """While tyro parses: a refusal it can describe in one line raises _Refused instead of printing its
    box."""
    if _on_parse_error is None:  # pragma: no cover
        yield
        return
    with _on_parse_error(_refuse):
        yield


def _refuse(event: Any) -> None:
    """tyro's parse-error hook: raise _Refused with the one line, or return to let tyro report it."""
    try:
        message = _describe(event)
    except (AttributeError, TypeError):  # the hook's events are tyro internals: a changed one gets tyro's box
        return
    if message is not None:
        raise _Refused(message)


def _describe(event: Any) -> str | None:
    """One line for the refusals a flashdapo command line can meet; None for the others."""
    from tyro import _errors

    if isinstance(event, _errors.InvalidChoice):
        expected = ("true or false (also True/False, 1/0)" if set(event.choices) == set(_BOOL_CHOICES)
                    else "one of " + ", ".join(event.choices))
        return f"{_flag(event.argument)}: invalid choice {event.value!r}; expected {expected}"
    if isinstance(event, _errors.InstantiationFailure):
        name = _flag(event.argument) if event.argument is not None else None
        message = " ".join(event.message.split())
        union = _UNION_FAILURE.match(message)  # `float | None` lists each member's refusal: say what it takes
        if union:
            message = f"expected {_union_words(union['metavar'])}, got {union['value']}"
        return f"{name}: {message}" if name else message
    if isinstance(event, _errors.UnrecognizedArgs):
        return "unrecognized argument(s): " + " ".join(event.tokens)
    if isinstance(event, _errors.MissingArgs):
        return "missing option(s): " + ", ".join(_flag(a.arg) for a in event.missing_arguments)
    if isinstance(event, _errors.BadValue):
        if event.reason == "too_few_values":
            return f"{_flag(event.argument)}: expected a value"
        return f"{_flag(event.argument)}: takes no value, got {event.offending_value!r}"
    return None


def _union_words(metavar: str) -> str:
    """What an optional number takes, in the words of the number rule (`{None}|INT` -> 'an integer'): None is
    the value of leaving it out (its help says what that means)."""
    words = {"INT": "an integer", "FLOAT": "a number"}
    kinds = [m for m in metavar.split("|") if m != "{None}"]
    return " or ".join(words.get(m, m) for m in kinds) if kinds else metavar


_UNION_FAILURE = re.compile(
    r"no type matching (?P<metavar>\S+) could be instantiated from \[(?P<value>.*?)\]\.")


def _flag(argument: Any) -> str:
    """The option's name as typed (`--trainer.total-steps`)."""
    return "/".join(argument.lowered.name_or_flags) or argument.display_name()


__all__ = ["BOOL_WORDS", "CLI_REGISTRY", "option", "parse", "resolve_config", "with_switch_values"]
