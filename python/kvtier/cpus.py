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

- :func:`resolve`: the connector's ``thread_cpus`` setting ("auto",
  "inherit" or a list such as ``"3,5-7"``) as a set of CPUs. "auto" is
  the cores vLLM reserves (its own list, when it binds automatically)
  that this process may use and no thread of it is bound to (OpenMP
  runtimes bind each compute thread to one CPU or to the worker's set):
  never another process's cores, which a binding of vLLM's given by hand
  (``VLLM_CPU_OMP_THREADS_BIND=0``) may leave to another engine.
- :func:`threads_on`: binds the calling thread to those CPUs while a block
  runs (the threads it starts keep them), then restores it.
- :func:`bind_thread`: binds the calling thread (a thread's first call).

An empty set always means "leave the binding as it is"; so does a
binding the kernel refuses (logged once).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Iterator

from kvtier.errors import InvalidArgument, StatusCode

log = logging.getLogger("vllm.kvtier")

_ONLINE_CPUS = "/sys/devices/system/cpu/online"
#: CPU numbers past this are refused (a typo such as "0-99999999" would
#: otherwise build a set of that size).
MAX_CPU = 1 << 16


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
        if last >= MAX_CPU:
            raise ValueError(f"{part!r} names a CPU past {MAX_CPU - 1}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _read_list(path: str) -> frozenset[int]:
    try:
        with open(path) as f:
            return parse_cpu_list(f.read().strip())
    except (OSError, ValueError):
        return frozenset()


def _cgroup_cpus() -> frozenset[int]:
    """The CPUs of this process's own cgroup (v2 ``cpuset.cpus.effective``,
    v1 ``cpuset.effective_cpus``); empty when neither can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":    # v2
            cpus = _read_list(f"/sys/fs/cgroup{path}/cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):    # v1
            cpus = _read_list(
                f"/sys/fs/cgroup/cpuset{path}/cpuset.effective_cpus")
        else:
            continue
        if cpus:
            return cpus
    return frozenset()


def process_cpus() -> frozenset[int]:
    """The CPUs this process may be bound to: its cgroup's (or the online
    ones), within its parent's binding when it has a parent other than
    init (vLLM's workers keep to their engine's binding)."""
    cpus = _cgroup_cpus() or _read_list(_ONLINE_CPUS)
    if not cpus:
        cpus = frozenset(range(os.cpu_count() or 1))
    parent = frozenset[int]()
    if os.getppid() > 1:
        try:
            parent = frozenset(os.sched_getaffinity(os.getppid()))
        except OSError:
            pass
    return cpus & parent if cpus & parent else cpus


def bound_cpus() -> frozenset[int]:
    """The CPUs that this process's bound threads (those whose binding is
    narrower than :func:`process_cpus`, the calling thread's among them)
    are bound to. An unbound thread adds nothing: vLLM's scheduler process
    binds none (where vLLM binds nothing at all, it reserves nothing
    either: :func:`kvtier.integrations.vllm_worker.vllm_reserved_cpus`)."""
    allowed = process_cpus()
    own = frozenset(os.sched_getaffinity(0))
    bound = own if own < allowed else frozenset[int]()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            mask = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:   # it ended
            continue
        if mask < allowed:
            bound |= mask
    return bound


def resolve(setting: str, where: str = "thread_cpus",
            reserved: frozenset[int] = frozenset()) -> frozenset[int]:
    """``setting`` as CPUs: "auto" is ``reserved`` (the cores the engine
    keeps free of compute) less those this process may not use and those
    a thread of it is bound to (:func:`bound_cpus`); "inherit" (or "")
    none (threads keep their creator's binding), else a CPU list, each of
    which this process must be allowed (InvalidArgument naming ``where``
    otherwise)."""
    text = setting.strip()
    if text in ("", "inherit"):
        return frozenset()
    if text == "auto":
        if not reserved:
            return frozenset()
        return (reserved & process_cpus()) - bound_cpus()
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


_refused: list[bool] = []


def _bind(cpus: frozenset[int]) -> bool:
    """Binds the calling thread; False (logged once) where the kernel
    refuses (none of ``cpus`` is the process's any more)."""
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except OSError as e:
        if not _refused:
            _refused.append(True)
            log.warning("kvtier: its threads could not be bound to CPUs %s "
                        "(%s); they keep their creator's binding",
                        ",".join(map(str, sorted(cpus))), e)
        return False


def bind_thread(cpus: frozenset[int]) -> None:
    """Binds the calling thread to ``cpus`` (nothing when empty, or when
    the kernel refuses)."""
    if cpus:
        _bind(cpus)


@contextlib.contextmanager
def threads_on(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread bound to ``cpus`` while the block runs, so the
    threads it starts there are too; its own binding back after (nothing
    changes when ``cpus`` is empty or the kernel refuses them)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    bound = _bind(cpus)
    try:
        yield
    finally:
        if bound:
            os.sched_setaffinity(0, before)
