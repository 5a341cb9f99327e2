"""Documented examples run as written.

- Every Python code block of README.md and docs/*.md: each is run as its
  own script, with Debian's interpreter and the build's package, against a
  real kvtier-store named by KVTIER_STORE (what the docs tell a reader to
  set).
- Every shell block marked ``<!-- doc-test -->`` (the README's quick start):
  run by bash from the repository's root, with the build tree at build/ (a
  symlink when the build is elsewhere), as a reader would paste it.

A documented example that no longer runs fails here."""

from __future__ import annotations

import os
import re
import signal
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


def shell_blocks() -> list[tuple[str, int, str]]:
    """(file, line, code) of every shell block marked <!-- doc-test -->."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^<!-- doc-test -->\n```(?:bash|sh)\n(.*?)^```$",
                             text, re.S | re.M):
            out.append((doc.name, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


SHELL = shell_blocks()


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


def test_the_readme_has_a_tested_quick_start() -> None:
    assert any(doc == "README.md" for doc, _, _ in SHELL)


@pytest.mark.parametrize("doc, line, code", SHELL,
                         ids=[f"{d}:{n}" for d, n, _ in SHELL])
def test_a_documented_shell_block_runs_as_written(
        tmp_path: Path, doc: str, line: int, code: str) -> None:
    from conftest import BUILD
    root = tmp_path / "clone"
    root.mkdir()
    (root / "build").symlink_to(BUILD)  # the docs say build/
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + code)
    env = engine_env()
    env.pop("PYTHONPATH", None)  # the block sets what it needs
    proc = subprocess.Popen(["bash", str(script)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:  # whatever the block started and left running (by its group)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                      stderr)
    assert out.returncode == 0, (
        f"{doc}:{line}: the block failed:\n{out.stdout}{out.stderr[-3000:]}")
