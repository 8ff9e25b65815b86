"""One tested environment: the library versions `make setup` resolves are the ones `make test` runs on.

`make test` adds vLLM's CPU build to the venv `make setup` made, and vLLM pins some of the libraries flashdapo
also uses (transformers, numpy). If pyproject.toml's ranges let a plain install resolve a version vLLM's pin
then moves, a user without vLLM runs on a version the suite never ran on. The Makefile snapshots the versions
after `make setup` and compares them after vLLM joins: a moved version fails the install in one line per
library, naming the range to narrow.

    python -m flashdapo.tools.environment snapshot FILE   # write {distribution: version} as JSON
    python -m flashdapo.tools.environment compare FILE    # exit 1, one line each, if a version moved
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

INSTALLERS = frozenset({"pip", "setuptools", "wheel"})
"""Tools of the venv itself, upgraded by whatever installs last: not libraries flashdapo runs on."""


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_versions() -> dict[str, str]:
    """{canonical distribution name: version} of this interpreter's environment, installers left out."""
    versions = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _canonical(name) not in INSTALLERS:
            versions[_canonical(name)] = dist.version
    return dict(sorted(versions.items()))


def moved_versions(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """One line per library present in both with another version after (new libraries are fine: the extra
    brought them; removed ones too: the Makefile removes vLLM's CUDA torchvision and friends)."""
    return [f"{name} {before[name]} -> {after[name]}: `make setup` resolves {before[name]}, the test venv "
            f"runs {after[name]}; narrow {name}'s range in pyproject.toml to the version the suite runs on"
            for name in sorted(before.keys() & after.keys()) if before[name] != after[name]]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("snapshot", "compare"):
        print("usage: python -m flashdapo.tools.environment {snapshot|compare} FILE", file=sys.stderr)
        return 2
    path = Path(args[1])
    if args[0] == "snapshot":
        path.write_text(json.dumps(installed_versions(), indent=1) + "\n")
        return 0
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        print(f"{path}: cannot read the versions `make setup` recorded ({err}); run `make setup` again",
              file=sys.stderr)
        return 2
    moved = moved_versions(before, installed_versions())
    for line in moved:
        print(line, file=sys.stderr)
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
