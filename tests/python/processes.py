"""Process control the tests and their helper processes share."""

from __future__ import annotations

import os
import signal
import time


def sigstop(pid: int, timeout: float = 5) -> None:
    """SIGSTOP, returning once the kernel reports the process stopped (kill
    returns before a busy process's threads have all stopped): its sockets
    stay open and nothing answers, as in a partition. RuntimeError if it
    is not stopped within ``timeout`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        if stat[stat.rindex(")") + 2] == "T":
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop")


def sigcont(pid: int) -> None:
    """SIGCONT: a process :func:`sigstop` stopped runs on."""
    os.kill(pid, signal.SIGCONT)


def dead_or_gone(pid: int, timeout: float = 5) -> None:
    """Returns once ``pid`` has died (a zombie its parent has not reaped,
    or gone): its sockets are closed. RuntimeError if it still runs after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            return
        if stat[stat.rindex(")") + 2] in "ZX":
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not die")
