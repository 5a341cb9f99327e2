"""The CPUs kvtier's own threads run on inside an engine that binds its
compute threads to cores.

vLLM's CPU build binds each worker's OpenMP threads, its main thread among
them, to the worker's cores (``VLLM_CPU_OMP_THREADS_BIND``) and keeps the
cores it reserves (``VLLM_CPU_NUM_OF_RESERVED_CPU``; one more per rank
with a KV connector, for the connector's transfers) free of them. A Linux
thread starts with its creator's binding, so every thread kvtier's
connector starts in that worker (the save lane, the C++ offloaders and
committers, the loaders, the closer) would otherwise copy bytes on the
very core the engine computes on, and a save behind the step would still
cost the step.

- :func:`spare_cpus`: the CPUs this process may use that the calling
  thread is not bound to (empty when it is bound to all of them).
- :func:`resolve`: the connector's ``thread_cpus`` setting ("auto",
  "inherit" or a list such as ``"3,5-7"``) as a set of CPUs.
- :func:`threads_on`: binds the calling thread to those CPUs while a block
  runs (the threads it starts keep them), then restores it.
- :func:`bind_thread`: binds the calling thread (a thread's first call).

An empty set always means "leave the binding as it is".
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator

from kvtier.errors import InvalidArgument, StatusCode

_CGROUP_CPUS = "/sys/fs/cgroup/cpuset.cpus.effective"
_ONLINE_CPUS = "/sys/devices/system/cpu/online"


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list (``"0-3,8,10-11"``). ValueError names
    the part that is not one."""
    cpus: set[int] = set()
    for part in "".join(text.split()).split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _read_list(path: str) -> frozenset[int]:
    try:
        with open(path) as f:
            return parse_cpu_list(f.read().strip())
    except (OSError, ValueError):
        return frozenset()


def process_cpus() -> frozenset[int]:
    """The CPUs this process may be bound to: its cgroup's (or the online
    ones), within its parent's binding when that can be read (a process
    started under ``taskset`` keeps to it)."""
    cpus = _read_list(_CGROUP_CPUS) or _read_list(_ONLINE_CPUS)
    if not cpus:
        cpus = frozenset(range(os.cpu_count() or 1))
    try:
        parent = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        parent = frozenset()
    return cpus & parent if cpus & parent else cpus


def spare_cpus() -> frozenset[int]:
    """The CPUs this process may use that the calling thread is not bound
    to: in a vLLM CPU worker's main thread, the cores vLLM keeps free of
    its OpenMP threads. Empty when the thread may run anywhere."""
    mine = frozenset(os.sched_getaffinity(0))
    return process_cpus() - mine


def resolve(setting: str, where: str = "thread_cpus") -> frozenset[int]:
    """``setting`` as CPUs: "auto" is :func:`spare_cpus`, "inherit" (or
    "") none (threads keep their creator's binding), else a CPU list, each
    of which this process must be allowed (InvalidArgument naming
    ``where`` otherwise)."""
    text = setting.strip()
    if text in ("", "inherit"):
        return frozenset()
    if text == "auto":
        return spare_cpus()
    try:
        cpus = parse_cpu_list(text)
    except ValueError as e:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f'{where}: {e} (takes "auto", "inherit" or a CPU list such as '
            '"3,5-7")') from None
    allowed = process_cpus()
    if not cpus or not cpus <= allowed:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"{where}: CPUs {sorted(cpus - allowed) or text!r} are not "
            f"this process's (it may use {_show(allowed)})")
    return cpus


def _show(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def bind_thread(cpus: frozenset[int]) -> None:
    """Binds the calling thread to ``cpus`` (nothing when empty)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def threads_on(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread bound to ``cpus`` while the block runs, so the
    threads it starts there are too; its own binding back after (nothing
    changes when ``cpus`` is empty)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
