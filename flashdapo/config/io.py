"""Overrides and config files (YAML or JSON, e.g. the output of `flashdapo config`), checked as strictly
as the command line: a section must be a mapping, a key given twice (two `optim:` sections) is refused
naming both lines, unknown keys are named, and every leaf goes through the same type and range checks as
a CLI value (checks.py). Errors are one line naming the file and field.

yaml is imported when a file is read, not with the config tree: the GPU machines' image has no yaml.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import Any

from .checks import ConfigError, field_spec, optional_inner, section_type


@functools.cache
def _strict_loader() -> tuple[type, type]:
    """(a yaml.SafeLoader that refuses a key given twice in one mapping, the error it raises), built on first
    use so that yaml is imported only when a file is read."""
    import yaml

    class DuplicateKey(yaml.constructor.ConstructorError):
        """A mapping holds the same key twice (PyYAML would silently keep the last)."""

    class StrictLoader(yaml.SafeLoader):
        """yaml.SafeLoader that refuses a key given twice in one mapping."""

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first_line.get(key)
                except TypeError:  # an unhashable key: the base class names it
                    break
                if earlier is not None:
                    raise DuplicateKey(
                        None, None, f"key {key!r} appears twice (first at line {earlier + 1}); "
                        "keep one", key_node.start_mark)
                first_line[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    return StrictLoader, DuplicateKey


# PyYAML reads YAML 1.1, where a float needs a dot: `lr: 1e-6` arrives as the string '1e-6'. Such a
# string is a number on the command line, so it is one here too; 'inf', 'nan' or 'ten' are not.
_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def merge(base: Any, overrides: Any, prefix: str = "") -> Any:
    """`base` (a config section) with the nested `overrides` mapping applied; every rebuilt section is
    checked again."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {_describe(overrides)}")
    known = [f.name for f in dataclasses.fields(base)]
    unknown = sorted(str(k) for k in overrides if k not in known)
    if unknown:
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    changes = {}
    for name, value in overrides.items():
        if section_type(type(base), name) is not None:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{prefix}{name}: expected a mapping (a config section), got {_describe(value)}")
            changes[name] = merge(getattr(base, name), value, f"{prefix}{name}.")
        else:
            changes[name] = _coerce(value, field_spec(type(base), name)[0])
    return dataclasses.replace(base, **changes)


def _coerce(value: Any, tp: Any) -> Any:
    """The conversions the command line also makes: a sequence for a tuple field becomes a tuple, an
    integer or a float literal for a float field becomes a float. Anything else is left for the checks."""
    tp = optional_inner(tp) or tp
    if tp is float:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            return float(value)
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        args = typing.get_args(tp)  # a list of the wrong length stays that long, for the checks to name
        return tuple(_coerce(v, args[min(i, len(args) - 1)]) for i, v in enumerate(value))
    return value


def _describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def load_file(path: str | Path, base: Any) -> Any:
    """Apply a YAML/JSON config file (full or partial) on top of `base` (`~` in its path is the home)."""
    path = Path(path).expanduser()
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read the file ({err.strerror})") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start})") from err
    import yaml

    loader, duplicate_key = _strict_loader()
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader)
    except duplicate_key as err:
        raise ConfigError(f"--config {path}: line {err.problem_mark.line + 1}: {err.problem}") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML/JSON{where}: {problem}") from err
    try:
        return merge(base, {} if data is None else data)
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from err
