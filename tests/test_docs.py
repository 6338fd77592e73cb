"""The docs site (issue 46): it builds with ``mkdocs build --strict`` (a broken link, a missing page or a nav entry
that points nowhere fails), every page is in the nav, README stays short and points into the site. The runnable
blocks run against a live server in tests/test_readme_tour.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests._docs_run import DOCS, REPO, runnable_blocks

MKDOCS = Path(sys.executable).with_name("mkdocs")


def nav_pages(nav: list) -> list[str]:
    out: list[str] = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run([str(MKDOCS), "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "job-spec" / "index.html").is_file()
    architecture = (tmp_path / "site" / "architecture" / "index.html").read_text()
    assert "Bucketed weight updates" in architecture  # ARCHITECTURE.md itself, included


def test_every_page_is_in_the_nav_and_readme_points_into_it() -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md"))
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert linked >= set(pages) - {"index.md"}, set(pages) - linked


def test_runnable_blocks_are_marked_blocks_only() -> None:
    blocks = runnable_blocks()
    assert blocks and all(b.lang in ("bash", "python") and b.code.strip() for b in blocks)
    marks = sum(p.read_text().count("<!-- run -->") for p in DOCS.glob("*.md"))
    assert marks == len(blocks)  # a mark not followed by a bash or python fence is a mistake, not a skip
