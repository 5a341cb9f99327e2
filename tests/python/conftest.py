"""Fixtures of kvtier's Python tests: the package from the build tree and
real kvtier-store processes on 127.0.0.1, each stopped by its pid.

ctest runs these with KVTIER_BUILD_DIR set; by hand:
    KVTIER_BUILD_DIR=build /usr/bin/python3 -m pytest tests/python
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

from processes import sigstop

# One BLAS thread per process (OpenBLAS spins a thread per core otherwise);
# before anything imports numpy or torch.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(BUILD / "python"))
os.environ.setdefault("UCX_TLS", "tcp,self,sm")


T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str | Callable[[], str],
               timeout: float = 30) -> T:
    """Calls ``check`` until it returns something true (returned), for
    ``timeout`` seconds at most; then fails saying what was awaited
    (``what``, or what it returns then: a log's tail, say) and what
    ``check`` last returned."""
    deadline = time.monotonic() + timeout
    while True:
        seen = check()
        if seen:
            return seen
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(
                f"{said}: not within {timeout} s (last seen: {seen!r})")
        time.sleep(0.01)


class Store:
    """A kvtier-store process; ``address`` once it serves."""

    def __init__(self, tmp: Path, name: str = "store",
                 ram: str = "64MiB", port: int = 0,
                 flags: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.name = name
        self.port_file = tmp / f"{name}.port"
        self.log = tmp / f"{name}.log"
        args = [str(BUILD / "cachestore" / "kvtier-store"),
                f"--listen=127.0.0.1:{port}", "--data-listen=127.0.0.1:0",
                f"--data-dir={tmp / (name + '-db')}", "--hugepages=false",
                f"--ram-bytes={ram}", f"--port-file={self.port_file}",
                *flags]
        # A port file left by an earlier store of this name would be read
        # as this one's before it writes its own.
        self.port_file.unlink(missing_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pause(self) -> None:
        """SIGSTOP, once the store has stopped (processes.sigstop): its
        sockets stay open and nothing answers, as in a partition."""
        sigstop(self.proc.pid)

    def resume(self) -> None:
        """SIGCONT."""
        os.kill(self.proc.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def slowed(self, stopped_ms: float, period_ms: float) -> Iterator[None]:
        """While the block runs, the store is stopped (SIGSTOP)
        ``stopped_ms`` of every ``period_ms`` and runs (SIGCONT) the rest:
        a store that answers everything, late, as one on a starved host or
        behind a congested link does. Running again when the block ends."""
        assert 0 < stopped_ms < period_ms, (stopped_ms, period_ms)
        done = threading.Event()

        def cycle() -> None:
            while not done.is_set():
                os.kill(self.proc.pid, signal.SIGSTOP)
                done.wait(stopped_ms / 1000)
                os.kill(self.proc.pid, signal.SIGCONT)
                done.wait((period_ms - stopped_ms) / 1000)

        cycler = threading.Thread(target=cycle, name="slowed-store",
                                  daemon=True)
        cycler.start()
        try:
            yield
        finally:
            done.set()
            cycler.join()
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, were it paused), SIGKILL after 10 s."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """One kvtier-store."""
    s = Store(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def two_stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """Two kvtier-store shards."""
    a, b = Store(tmp_path, "shard-a"), Store(tmp_path, "shard-b")
    yield a, b
    a.stop()
    b.stop()


def engine_env() -> dict[str, str]:
    """The environment of an engine subprocess: the build tree's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BUILD / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def served_port(proc: subprocess.Popen[bytes], port_file: Path, log: Path,
                timeout: float = 20) -> int:
    """The port a server started with ``--port-file`` listens on, once it
    wrote it; fails with the server's log if it exits first or takes longer
    than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not port_file.exists() or not port_file.read_text().strip():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{proc.args!r} did not start"
        time.sleep(0.05)
    return int(port_file.read_text())


def corrupt_in_store(store_pid: int, needle: bytes) -> bool:
    """Flips one byte of the first copy of ``needle`` in the store's RAM
    arena, behind the store's back (through /proc/PID/fd of its memfd, as a
    bad DIMM or a stray write would). False if the bytes are not there."""
    import mmap

    fd_dir = Path(f"/proc/{store_pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if not target.startswith("/memfd:kvtier-ram-tier"):
            continue
        with open(fd, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size) as m:
                at = m.find(needle)
                if at < 0:
                    return False
                m[at + 7] = m[at + 7] ^ 0xFF
                return True
    return False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With KVTIER_REQUIRE_ENGINES=1 (run_venv_pytest.sh sets it under
    CI=true) a skipped test is a failure: CI runs the real engines and the
    linters or fails, saying which test skipped and why. Elsewhere a skip
    stays a skip, with its reason."""
    if os.environ.get("KVTIER_REQUIRE_ENGINES") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if not skipped:
        return
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) \
            else str(report.longrepr)
        print(f"\nkvtier CI: {report.nodeid} skipped ({reason}); under "
              "CI=true the real-engine tests and the linters must run",
              file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
