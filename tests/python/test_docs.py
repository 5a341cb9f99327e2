"""Every Python code block of README.md and docs/*.md runs as written: each
is run as its own script, with Debian's interpreter and the build's
package, against a real kvtier-store named by KVTIER_STORE (what the docs
tell a reader to set). A documented example that no longer runs fails
here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Store, engine_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[tuple[str, int, str]]:
    """(file, line, code) of every ```python block."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 1
            out.append((doc.name, line, m.group(1)))
    return out


BLOCKS = python_blocks()


def test_the_docs_have_python_examples() -> None:
    assert BLOCKS, "no ```python block found in README.md or docs/"


@pytest.mark.parametrize("doc, line, code", BLOCKS,
                         ids=[f"{d}:{n}" for d, n, _ in BLOCKS])
def test_a_documented_python_example_runs_as_written(
        store: Store, tmp_path: Path, doc: str, line: int, code: str) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = engine_env()
    env["KVTIER_STORE"] = store.address
    out = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, (
        f"{doc}:{line}: the example failed:\n{out.stdout}{out.stderr[-3000:]}")
