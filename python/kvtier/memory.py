"""Zero-copy access to memory handed to kvtier from Python.

kvtier moves bytes straight into and out of the caller's memory, so it needs
an address, a size and the object that owns them (kept alive by the caller
for as long as kvtier may touch it). :func:`region_of` takes any of:

- a ``torch.Tensor`` (``data_ptr()``; host memory in this version),
- an object with ``__dlpack__`` (NumPy arrays, CuPy, JAX, ...),
- an object with the buffer protocol (``bytearray``, ``memoryview``, ...),

and never copies. Objects that are not contiguous are refused with
:class:`kvtier.errors.InvalidArgument`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidArgument, StatusCode


@dataclass(frozen=True)
class Region:
    """A contiguous range of host memory: ``nbytes`` bytes at ``address``."""

    address: int
    nbytes: int
    owner: Any


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT, message)


def as_tensor(obj: Any) -> Any:
    """``obj`` as a ``torch.Tensor`` sharing its memory (no copy).

    Raises InvalidArgument for an object that is none of a tensor, a DLPack
    producer or a buffer.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return obj
    if hasattr(obj, "__dlpack__"):
        return torch.utils.dlpack.from_dlpack(obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise _bad(f"{type(obj).__name__} exposes no memory (not a tensor, "
                   "DLPack producer or buffer)") from None
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


def region_of(obj: Any, writable: bool = False) -> Region:
    """The contiguous host memory of ``obj``, without copying.

    ``writable``: kvtier will write into it (a read-only buffer is refused).
    Raises InvalidArgument for device memory, a non-contiguous tensor or an
    object that exposes no memory.
    """
    if isinstance(obj, (bytes, bytearray, memoryview)):
        import numpy as np

        try:
            a = np.frombuffer(obj, dtype=np.uint8)
        except (ValueError, TypeError) as e:
            raise _bad(f"the buffer cannot be used: {e}") from None
        if writable and not a.flags.writeable:
            raise _bad("the destination is read-only")
        return Region(int(a.ctypes.data) if a.size else 0, int(a.nbytes),
                      (obj, a))
    t = as_tensor(obj)
    if t.device.type != "cpu":
        raise _bad(f"memory on {t.device} is not supported yet: kvtier moves "
                   "host memory in this version (docs/engines.md)")
    if not t.is_contiguous():
        raise _bad("the tensor is not contiguous")
    return Region(t.data_ptr(), t.numel() * t.element_size(), (obj, t))
