"""Documented examples run as written.

- Every Python code block of README.md and docs/*.md: each is run as its
  own script, with Debian's interpreter and the build's package, against a
  real kvtier-store named by KVTIER_STORE (what the docs tell a reader to
  set).
- Every other code block carries a marker on the line above it:
  ``<!-- doc-test -->``: run by bash from the repository's root, with the
  build tree at build/ (a symlink when the build is elsewhere), as a reader
  would paste it (the README's quick start);
  ``<!-- doc-flags -->``: run the same way with ``KVTIER_FLAGS_ONLY=1``, with
  which every kvtier program (the C++ binaries, kvctl, the Python scripts)
  parses its flags and exits, so a renamed or mistyped flag fails while
  long runs (benchmarks, servers) do not start; other commands in the block
  run for real;
  ``<!-- doc-skip: REASON -->``: not run, and the reason says why (a GPU, a
  diagram, a formula).
  A block with no marker fails the test.

A documented example that no longer runs fails here."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def marked_blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, marker, code) of every fenced block that is not
    ```python; marker is the comment on the line above ("" if none)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M):
            if m.group(1) == "python":
                continue
            above = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = re.match(r"<!-- (doc-test|doc-flags|doc-skip: .+) -->$",
                              above.strip())
            out.append((doc.name, text.count("\n", 0, m.start()) + 1,
                        marker.group(1) if marker else "", m.group(2)))
    return out


MARKED = marked_blocks()
SHELL = [(d, n, c) for d, n, k, c in MARKED if k == "doc-test"]
FLAGS = [(d, n, c) for d, n, k, c in MARKED if k == "doc-flags"]


def test_every_code_block_is_run_or_says_why_not() -> None:
    unmarked = [f"{d}:{n}" for d, n, k, _ in MARKED if not k]
    assert not unmarked, (
        "code blocks with no <!-- doc-test -->, <!-- doc-flags --> or "
        f"<!-- doc-skip: REASON --> marker: {', '.join(unmarked)}")
    skipped = [k for _, _, k, _ in MARKED if k.startswith("doc-skip")]
    assert all(len(k) > len("doc-skip: ") + 5 for k in skipped), \
        "a doc-skip marker says why"


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


def run_block(tmp_path: Path, code: str, flags_only: bool
              ) -> subprocess.CompletedProcess:
    """Runs a shell block from a directory laid out as the repository's
    root (its scripts/, bench/ and python/, the build tree at build/), and
    stops whatever it left running."""
    from conftest import BUILD
    root = tmp_path / "clone"
    root.mkdir()
    (root / "build").symlink_to(BUILD)  # the docs say build/
    for sub in ("scripts", "bench", "python"):
        (root / sub).symlink_to(ROOT / sub)
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + code)
    env = engine_env()
    env.pop("PYTHONPATH", None)  # the block sets what it needs
    if flags_only:
        env["KVTIER_FLAGS_ONLY"] = "1"
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
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                       stderr)


@pytest.mark.parametrize("doc, line, code", SHELL,
                         ids=[f"{d}:{n}" for d, n, _ in SHELL])
def test_a_documented_shell_block_runs_as_written(
        tmp_path: Path, doc: str, line: int, code: str) -> None:
    out = run_block(tmp_path, code, flags_only=False)
    assert out.returncode == 0, (
        f"{doc}:{line}: the block failed:\n{out.stdout}{out.stderr[-3000:]}")


@pytest.mark.parametrize("doc, line, code", FLAGS,
                         ids=[f"{d}:{n}" for d, n, _ in FLAGS])
def test_a_documented_command_line_takes_its_flags(
        tmp_path: Path, doc: str, line: int, code: str) -> None:
    from conftest import BUILD
    if "build/venv/" in code and not (BUILD / "venv" / "bin" / "python").exists():
        why = BUILD / "venv.unavailable"
        pytest.skip(why.read_text().strip() if why.exists()
                    else "the project's Python environment is not made")
    out = run_block(tmp_path, code, flags_only=True)
    assert out.returncode == 0, (
        f"{doc}:{line}: a command line's flags were refused:\n"
        f"{out.stdout}{out.stderr[-3000:]}")


def engine_command_configs() -> list[tuple[int, str, dict[str, Any]]]:
    """(line, flag, parsed JSON) of every JSON flag value of the engine
    command lines in docs/engines.md (``vllm serve``, SGLang's server)."""
    text = (ROOT / "docs" / "engines.md").read_text()
    out = []
    for m in re.finditer(r"^```\n((?:vllm serve|python -m sglang).*?)^```$",
                         text, re.S | re.M):
        line = text.count("\n", 0, m.start()) + 1
        for f in re.finditer(r"(--[a-z-]+-config) '(.*?)'", m.group(1), re.S):
            out.append((line, f.group(1), json.loads(f.group(2))))
    return out


def class_defined(module: str, name: str) -> bool:
    """Whether the kvtier package module defines class ``name`` (read from
    its source: the engines need not be installed here)."""
    path = ROOT / "python" / Path(*module.split(".")).with_suffix(".py")
    return path.exists() and any(
        isinstance(n, ast.ClassDef) and n.name == name
        for n in ast.parse(path.read_text()).body)


def test_the_engine_pages_configs_are_the_ones_the_tests_run() -> None:
    """The vLLM and SGLang command lines of docs/engines.md (which need a
    GPU, so they are not run) carry JSON that parses, naming kvtier's
    classes and keys as the engine tests use them: editing them so they
    break fails here."""
    from vllm_engine import kv_transfer_config
    configs = engine_command_configs()
    kv = [c for _, f, c in configs if f == "--kv-transfer-config"]
    assert len(kv) == 2 and len(configs) >= 5, configs
    connector = next(c for c in kv if c["kv_connector"] == "KvtierConnector")
    tested = kv_transfer_config("STORES")
    for key in ("kv_connector", "kv_connector_module_path", "kv_role",
                "kv_load_failure_policy"):
        assert connector[key] == tested[key], key
    assert class_defined(connector["kv_connector_module_path"],
                         "KvtierConnector")
    # The tier's keys: every Option(...) of its own and the store
    # client's (read from the source: vLLM is not installed here).
    tier_keys = {
        ast.literal_eval(n.args[0])
        for path in ("integrations/vllm_tier.py", "options.py")
        for n in ast.walk(ast.parse(
            (ROOT / "python/kvtier" / path).read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Option"}
    assert {"stores", "io_threads", "lookup_budget_ms"} <= tier_keys
    offloading = next(c for c in kv if c["kv_connector"] == "OffloadingConnector")
    extra = offloading["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert class_defined(tier["module_path"], tier["type"])
    assert set(tier) - {"type", "module_path"} <= set(tier_keys), tier
    (sglang,) = [c for _, f, c in configs
                 if f == "--hicache-storage-backend-extra-config"]
    assert class_defined(sglang["module_path"], sglang["class_name"])
    assert sglang["interface_v1"] == 1 and sglang["stores"]
