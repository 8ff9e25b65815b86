"""The documentation keeps up with the code: every config field has its line in docs/config.md, and every
relative link in README.md and docs/*.md points to a file that exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from flashdapo.config import Config

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = ROOT / "docs" / "config.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""A markdown link or image: [text](target) or ![alt](target "title")."""


def field_paths(section, prefix: str) -> list[str]:
    """`section.field` of every leaf field under `section` (nested sections such as data.toy included)."""
    paths = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        path = f"{prefix}.{f.name}"
        paths += field_paths(value, path) if dataclasses.is_dataclass(value) else [path]
    return paths


def all_fields() -> list[str]:
    cfg = Config()
    return [p for f in dataclasses.fields(cfg) for p in field_paths(getattr(cfg, f.name), f.name)]


def test_the_tree_has_fields():
    fields = all_fields()
    assert len(fields) > 100 and "optim.lr" in fields and "data.toy.held_out_val" in fields


@pytest.mark.parametrize("path", all_fields())
def test_every_config_field_is_documented(path):
    assert f"`{path}`" in CONFIG_PAGE.read_text(), (
        f"{path} has no line in docs/config.md: add `{path}` with its default and a one-line meaning")


def relative_links(page: Path) -> list[str]:
    """The link targets of `page` that are files of this repository (no URL, no in-page anchor)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_files(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](exists.md) [b](missing.md#part) [c](https://example.com) [d](#here)\n"
                    "```\n[e](in-code.md)\n```\n")
    (tmp_path / "exists.md").write_text("")
    assert relative_links(page) == ["exists.md", "missing.md"]
    assert [t for t in relative_links(page) if not (page.parent / t).exists()] == ["missing.md"]
