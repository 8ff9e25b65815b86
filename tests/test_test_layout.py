"""The tests' own layout. Helpers two test modules share live in tests/helpers/ (or, as fixtures, in a
conftest.py): no module under tests/ imports a test module, whether absolutely, relatively, inside a
function or as a top-level module (tests/kernels' style). Each test module sits in the folder of what it
tests: tests/X/Y/ for flashdapo/X/Y/ (tests/bench for bench/), tests/ itself for flashdapo's top-level
modules; the few exceptions are named below with their reason. Every folder of test modules is a package
but tests/kernels, whose modules import kernel_accuracy as a top-level module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

TOP_LEVEL = {
    "test_layers.py": "the layering of every flashdapo package (docs/architecture.md)",
    "test_loss_agg.py": "algorithm.py's loss aggregation modes",
    "test_preflight_engine_model.py": "preflight.py's checks of the model against the rollout engine (vLLM's limits)",
    "test_rollout_correction.py": "algorithm.py's rollout correction",
    "test_test_layout.py": "this file: the tests' own layout",
}
"""Test modules at tests/ top level whose name is no top-level module of flashdapo, and what they test."""
FOLDERS = {
    "evaluation": ROOT / "flashdapo" / "eval",
    "bench": ROOT / "bench",
    "vllm": None,
}
"""Test folders named otherwise than what they test: tests/evaluation holds flashdapo/eval's tests, tests/bench
those of bench/ (beside flashdapo), tests/vllm the runs on real vLLM (its CPU build, the `vllm` marker)
across rollout/ and trainer/: grouped by what they need installed, as docs/vllm.md lists them."""
NO_TESTS = ("helpers", "data")
"""Folders that hold no test module: shared helpers, data files."""


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def is_test_module(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def _imported_names(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in `path`, relative ones resolved against its package; for `from M
    import a` both M and M.a (a may be a module). Also importlib.import_module / __import__ of a literal."""
    package = path.relative_to(root).parent.parts
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def imports_of_test_modules(path: Path, root: Path) -> list[str]:
    """`file:line: module` for each import in `path` of a test module (test_*.py) found under `root`: by its
    dotted path from `root` or, as a top-level module, beside `path`."""
    found = []
    for line, name in _imported_names(path, root):
        parts = name.split(".")
        if not parts[-1].startswith("test_"):
            continue
        for base in (root, path.parent):
            target = base.joinpath(*parts).with_suffix(".py")
            if target.is_file():
                found.append(f"{path.relative_to(root)}:{line}: {target.relative_to(root)}")
                break
    return found


def test_no_module_under_tests_imports_a_test_module():
    found = [hit for path in python_files(TESTS) for hit in imports_of_test_modules(path, ROOT)]
    assert not found, "shared helpers belong in tests/helpers/ or a conftest.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source, caught", [
    ("from tests.pkg.test_a import helper\n", True),
    ("import tests.pkg.test_a\n", True),
    ("from tests.pkg import test_a\n", True),
    ("from .test_a import helper\n", True),
    ("from . import test_a\n", True),
    ("from ..pkg.test_a import helper\n", True),
    ("def f():\n    from tests.pkg.test_a import helper\n", True),
    ("import importlib\nm = importlib.import_module('tests.pkg.test_a')\n", True),
    ("import test_a\n", True),  # top-level, beside the importer (sys.path holds its folder)
    ("from tests.pkg.helper import test_like_name\n", False),  # a function so named, from a helper
    ("from tests.pkg import helper\n", False),
    ("from tests.pkg.test_missing import x\n", False),  # no such file: nothing to report
])
def test_the_import_check_catches_planted_imports(tmp_path, source, caught):
    pkg = tmp_path / "tests" / "pkg"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "test_a.py", "helper.py"):
        (pkg / name).write_text("def test_like_name():\n    pass\n")
    (tmp_path / "tests" / "__init__.py").write_text("")
    importer = pkg / "test_b.py"
    importer.write_text(source)
    assert bool(imports_of_test_modules(importer, tmp_path)) == caught, source


def _imports_bench(path: Path) -> bool:
    """Whether the module imports the top-level bench/ folder at module level (what it tests is a bench)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] == "bench" for name in names):
            return True
    return False


def _misplaced(path: Path) -> str | None:
    """Why `path` (a test module) is not where it belongs, or None."""
    folder = path.parent.relative_to(TESTS).parts
    if _imports_bench(path) and folder[:1] != ("bench",):
        return "imports bench/ at module level: a bench's tests go in tests/bench"
    if not folder:
        if path.name in TOP_LEVEL or (ROOT / "flashdapo" / path.name.removeprefix("test_")).is_file():
            return None
        return "at tests/ top level, but flashdapo has no top-level module of that name (a package's tests " \
               "go in its folder; a new exception goes in TOP_LEVEL with its reason)"
    if folder[0] in NO_TESTS:
        return f"tests/{folder[0]} holds no test modules"
    if folder[0] in FOLDERS:
        subject = FOLDERS[folder[0]]
        if subject is None or subject.joinpath(*folder[1:]).is_dir():
            return None
        return f"tests/{'/'.join(folder)} has no counterpart in {subject.relative_to(ROOT)}"
    if (ROOT / "flashdapo").joinpath(*folder).is_dir():
        return None
    return f"tests/{'/'.join(folder)} has no counterpart flashdapo/{'/'.join(folder)}"


def test_every_test_module_sits_in_the_folder_of_what_it_tests():
    misplaced = [f"{p.relative_to(ROOT)}: {why}" for p in python_files(TESTS) if is_test_module(p)
                 if (why := _misplaced(p))]
    assert not misplaced, "\n".join(misplaced)


def test_every_test_folder_is_a_package():
    """Test modules of the same name in two folders then import as two modules (tests.a.test_x and
    tests.b.test_x)."""
    folders = {p.parent for p in python_files(TESTS) if is_test_module(p)}
    missing = [str(f.relative_to(ROOT)) for f in sorted(folders - {TESTS / "kernels"})
               if not (f / "__init__.py").is_file()]
    assert not missing, f"no __init__.py in {missing}"
    # tests/kernels' modules import kernel_accuracy as a top-level module: a package there would break them.
    assert not (TESTS / "kernels" / "__init__.py").exists()
