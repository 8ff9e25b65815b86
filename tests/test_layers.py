"""The package's imports go down the layer table of docs/architecture.md and form no cycle.

Every import is read from the source (lazy ones inside functions included), so a new `from ..trainer import x`
in eval/ fails here before anyone runs it. The checker is also run on planted packages: an up-import and a
cycle must each be caught, so that a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashdapo"
TABLE = ROOT / "docs" / "architecture.md"


def layer_table(text: str) -> dict[str, int]:
    """{dotted unit (without the package name): layer} from the rows between the layers markers."""
    block = text.split("<!-- layers:", 1)[1].split("<!-- /layers -->", 1)[0]
    layers: dict[str, int] = {}
    for row in block.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for unit in re.findall(r"`([\w.]+)`", cells[1]):
                layers[unit] = int(cells[0])
    return layers


def module_names(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under `package` (a package is its __init__)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    top = name.split(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule; `from mod import name` the module.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == top and target != name:
                found.add(target)
    return found


def graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of the nearest unit in the table at or above `module` (None: the package itself)."""
    parts = module.split(".")[1:]
    while parts:
        unit = ".".join(parts)
        if unit in layers:
            return layers[unit]
        parts.pop()
    return None


def upward_imports(imports: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    bad = []
    for module, targets in sorted(imports.items()):
        mine = layer_of(module, layers)
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_edges(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between the top-level packages and modules (flashdapo.trainer, flashdapo.eval, ...)."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module, targets in imports.items():
        for target in targets:
            if unit(target) != unit(module):
                edges.setdefault(unit(module), set()).add(unit(target))
    return edges


def check(package: Path, layers: dict[str, int]) -> list[str]:
    imports = graph(package)
    problems = upward_imports(imports, layers)
    problems += [f"module cycle: {' <-> '.join(c)}" for c in cycles(imports)]
    problems += [f"package cycle: {' <-> '.join(c)}" for c in cycles(package_edges(imports))]
    return problems


def test_every_import_goes_down_the_stated_layers_and_nothing_cycles():
    layers = layer_table(TABLE.read_text())
    assert layers["errors"] == 0 and layers["__main__"] == max(layers.values())
    assert check(PACKAGE, layers) == []


def test_every_top_level_unit_has_a_layer():
    """A new top-level module or package gets its row in the table (else it would be checked against nothing)."""
    layers = layer_table(TABLE.read_text())
    tops = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert sorted(tops - set(layers)) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "flashdapo"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


LAYERS = layer_table(TABLE.read_text())


def test_a_planted_up_import_is_caught(tmp_path):
    package = _plant(tmp_path, {
        "__init__.py": "", "eval/__init__.py": "", "trainer/__init__.py": "", "trainer/loop.py": "X = 1\n",
        # lazy, inside a function: still an import
        "eval/command.py": "def main():\n    from ..trainer.loop import X\n    return X\n"})
    assert check(package, LAYERS) == [
        f"flashdapo.eval.command (layer {LAYERS['eval']}) imports flashdapo.trainer.loop (layer {LAYERS['trainer']})"]


def test_a_planted_cycle_is_caught(tmp_path):
    package = _plant(tmp_path, {
        "__init__.py": "", "eval/__init__.py": "",
        "eval/a.py": "from .b import Y\nX = 1\n", "eval/b.py": "def f():\n    from .a import X\nY = 2\n"})
    assert check(package, LAYERS) == ["module cycle: flashdapo.eval.a <-> flashdapo.eval.b",
                                      ]


def test_a_planted_package_cycle_is_caught(tmp_path):
    """Two packages of one layer importing each other: no module cycle, still a cycle of packages."""
    package = _plant(tmp_path, {
        "__init__.py": "", "rollout/__init__.py": "", "tasks/__init__.py": "",
        "rollout/a.py": "from ..tasks.c import Z\n", "rollout/b.py": "Y = 1\n",
        "tasks/c.py": "Z = 1\n", "tasks/d.py": "from ..rollout.b import Y\n"})
    assert check(package, LAYERS) == ["package cycle: flashdapo.rollout <-> flashdapo.tasks"]


@pytest.mark.parametrize("unit", ["kernels", "models", "sync", "trainer.state"])
def test_the_table_names_the_rooms(unit):
    assert unit in LAYERS


def private_imports(package: Path) -> list[str]:
    """`from module import _name` of another module of the package: a boundary drawn in the wrong place."""
    found = []
    for name, path in sorted(module_names(package).items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("flashdapo")):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports(PACKAGE) == []


def test_a_planted_private_import_is_caught(tmp_path):
    package = _plant(tmp_path, {"__init__.py": "", "eval/__init__.py": "", "eval/a.py": "_X = 1\n",
                                "eval/b.py": "from .a import _X\n"})
    assert private_imports(package) == ["flashdapo.eval.b imports a._X"]


def layout_entries(text: str) -> dict[str, str]:
    """{path under the package ('trainer/', 'trainer/loop.py'): its text} from the module tree of "The package
    layout": an entry is a name at the tree's indentation (2 spaces a level), its text the rest of its line and
    the description lines under it."""
    block = text.split("## The package layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    parents: list[tuple[int, str]] = []
    current = None
    for line in block.splitlines():
        match = re.match(r"^( +)(\S+)(.*)$", line)
        if not match:
            continue
        indent, name, rest = len(match.group(1)), match.group(2), match.group(3)
        if indent < 10 and (name.endswith("/") or name.endswith(".py")):
            while parents and parents[-1][0] >= indent:
                parents.pop()
            current = (parents[-1][1] if parents else "") + name
            entries[current] = rest
            if name.endswith("/"):
                parents.append((indent, current))
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _named(module: Path, entries: dict[str, str]) -> bool:
    """Whether the tree names `module` (a path under the package): as an entry of its own, or by its file name (or
    its path below the entry) in the text of an entry for a folder above it."""
    rel = module.relative_to(PACKAGE).as_posix()
    if rel in entries:
        return True
    parts = rel.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:depth]) + "/"
        below = "/".join(parts[depth:])
        if folder in entries and re.search(rf"(?<![\w/.]){re.escape(below)}\b", entries[folder]):
            return True
        if folder in entries and depth == len(parts) - 1 and re.search(rf"(?<![\w/.]){re.escape(parts[-1])}\b",
                                                                    entries[folder]):
            return True
    return False


def test_the_module_tree_names_every_module():
    """docs/architecture.md's tree is the map a reader navigates by: every module of the package is in it (an
    `__init__.py` is its folder's entry)."""
    entries = layout_entries(TABLE.read_text())
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]
    assert [p.relative_to(PACKAGE).as_posix() for p in modules if not _named(p, entries)] == []


def test_every_module_the_tree_names_exists():
    """A module renamed or removed leaves no stale name in the map: every `x.py` an entry names exists in that
    entry's folder or below it."""
    stale = []
    for path, text in layout_entries(TABLE.read_text()).items():
        base = PACKAGE / path if path.endswith("/") else (PACKAGE / path).parent
        if not path.endswith("/") and not (PACKAGE / path).is_file():
            stale.append(path)
        for name in re.findall(r"(?<![\w/.])([\w/]+\.py)\b", text):
            if not (base / name).is_file() and not any(base.rglob(name)) and not (PACKAGE / name).is_file():
                stale.append(f"{path}: {name}")
    assert stale == []


def test_a_module_missing_from_the_tree_is_caught():
    text = "## The package layout\n\n```\nflashdapo/\n  models/  policy.py, hf.py\n```\n"
    entries = layout_entries(text)
    assert _named(PACKAGE / "models" / "hf.py", entries) and not _named(PACKAGE / "models" / "packing.py", entries)
