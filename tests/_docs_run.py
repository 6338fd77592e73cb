"""Docs that run: the code blocks the docs mark runnable (an HTML comment ``<!-- run -->`` on the line before the
fence, invisible on the site), run as a reader would against a live server.

Why a marker and not every block: a page also shows what cannot run here (a GPU launch, a cluster, a command that
serves until stopped). A marked block runs with the port a reader would use (8000) replaced by the live server's,
``SLIME_GATEWAY__PORT`` set so the CLI's defaults reach it too, and the repository's virtual environment first on
``PATH``; it passes when it exits 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = re.compile(r"^<!-- run -->\n```(bash|python)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}: {self.code.splitlines()[0][:60]}"


def runnable_blocks(root: Path = DOCS) -> list[Block]:
    """Every marked block of the site's pages (``docs/*.md``), page by page in name order, in page order."""
    return [Block(page.name, m[1], m[2]) for page in sorted(root.glob("*.md")) for m in MARK.finditer(page.read_text())]


def run_block(block: Block, port: int, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    code = block.code.replace("localhost:8000", f"localhost:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    env = {**os.environ, "SLIME_GATEWAY__PORT": str(port), "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
