"""An engine's kvtier settings, read and checked once, at start-up.

Every integration (vLLM's connector, vLLM's offloading tier, SGLang's
HiCache backend) takes kvtier's settings as a JSON object inside the
engine's own config. :func:`read_options` checks that object against the
integration's :class:`Option` list before anything is built: an unknown key
(a typo such as ``"lookup_wait"``), a wrong type (``"deadline_ms": "10s"``,
``2.5`` for an integer, ``true`` for a number) or a value out of range is an
:class:`~kvtier.errors.InvalidArgument` that names the key, what it takes
and where it was read; nothing is coerced or dropped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from kvtier.errors import InvalidArgument, StatusCode


@dataclass(frozen=True)
class Option:
    """One key: its ``kind`` ("int", "number", "str", "bool" or "stores":
    a comma-separated string or a list of ``HOST:PORT``), its default (None:
    required), the smallest and largest values a number takes, the strings
    it takes (``choices``), and what it means (for the error messages)."""

    name: str
    kind: str
    default: Any
    what: str
    low: float = -math.inf
    high: float = math.inf
    choices: tuple[str, ...] = ()


def _bad(where: str, key: str, message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT,
                           f'{where}: "{key}" {message}')


def _check(where: str, opt: Option, value: Any) -> Any:
    """``value`` of ``opt``, checked (InvalidArgument naming the key)."""
    shown = f"{value!r} ({type(value).__name__})"
    if opt.kind == "stores":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(
                isinstance(s, str) for s in items):
            raise _bad(where, opt.name, "takes kvtier-store addresses, "
                       "\"HOST:PORT,HOST:PORT\" or a list of \"HOST:PORT\" "
                       f"strings, not {shown}")
        stores = [s.strip() for s in items if s.strip()]
        for s in stores:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise _bad(where, opt.name, f"has {s!r}, which is not "
                           "HOST:PORT (a port from 1 to 65535)")
        if not stores:
            raise _bad(where, opt.name, "names no kvtier-store (set it to "
                       "\"HOST:PORT\", e.g. \"127.0.0.1:7400\")")
        return stores
    if opt.kind == "bool":
        if not isinstance(value, bool):
            raise _bad(where, opt.name, f"takes true or false, not {shown}")
        return value
    if opt.kind == "str":
        if not isinstance(value, str):
            raise _bad(where, opt.name, f"takes a string ({opt.what}), "
                       f"not {shown}")
        if opt.choices and value not in opt.choices:
            raise _bad(where, opt.name, f"takes one of "
                       f"{', '.join(map(repr, opt.choices))}, not {value!r}")
        return value
    integer = opt.kind == "int"
    ok = (isinstance(value, int) if integer else
          isinstance(value, (int, float))) and not isinstance(value, bool)
    if not ok or not (opt.low <= value <= opt.high):
        kind = "an integer" if integer else "a number"
        span = (f" from {_num(opt.low)} to {_num(opt.high)}"
                if opt.high < math.inf else f" >= {_num(opt.low)}")
        raise _bad(where, opt.name, f"takes {kind}{span} ({opt.what}), "
                   f"not {shown}")
    return int(value) if integer else float(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def read_options(extra: Optional[Mapping[str, Any]],
                 options: Sequence[Option], where: str,
                 ignore: Sequence[str] = ()) -> dict[str, Any]:
    """Every option's value from ``extra`` (its default when absent),
    checked. ``ignore``: keys another layer owns (left alone). Raises
    InvalidArgument naming ``where`` and the key for an unknown key, a
    missing required one, or a value of the wrong type or range."""
    extra = dict(extra or {})
    known = {o.name: o for o in options}
    for key in extra:
        if key not in known and key not in ignore:
            raise _bad(where, str(key), "is not a kvtier setting (kvtier's "
                       f"settings here: {', '.join(sorted(known))})")
    out: dict[str, Any] = {}
    for opt in options:
        if opt.name in extra:
            out[opt.name] = _check(where, opt, extra[opt.name])
        elif opt.default is None and opt.kind == "stores":
            raise _bad(where, opt.name, "names no kvtier-store (set it to "
                       "\"HOST:PORT\", e.g. \"127.0.0.1:7400\")")
        elif opt.default is None:
            raise _bad(where, opt.name, f"is required ({opt.what})")
        else:
            out[opt.name] = opt.default
    return out


#: The store client's settings, shared by every integration.
CLIENT_OPTIONS: tuple[Option, ...] = (
    Option("stores", "stores", None,
           "the kvtier-store shards, \"HOST:PORT,HOST:PORT\""),
    Option("deadline_ms", "int", 10000,
           "milliseconds any one store call may take", 1, 3_600_000),
    Option("shared_memory", "str", "auto",
           "map a same-host store's arena", choices=("auto", "on", "off")),
    Option("tls_ca", "str", "", "a PEM file: TLS towards the stores"),
    Option("tls_cert", "str", "", "a PEM file: this client's certificate"),
    Option("tls_key", "str", "", "a PEM file: this client's key"),
)


def client_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The StoreClient / Connector keyword arguments among checked
    ``values`` (everything of CLIENT_OPTIONS but ``stores``)."""
    return {o.name: values[o.name] for o in CLIENT_OPTIONS
            if o.name != "stores"}


def store_options(extra: Mapping[str, Any], where: str
                  ) -> tuple[list[str], dict[str, Any]]:
    """The store shards and client options of an engine's config that
    holds kvtier's client settings among its own (keys other than
    CLIENT_OPTIONS are left to the caller). InvalidArgument naming
    ``where`` and the key for a missing store or a bad value."""
    mine = {k: v for k, v in dict(extra or {}).items()
            if k in {o.name for o in CLIENT_OPTIONS}}
    values = read_options(mine, CLIENT_OPTIONS, where)
    return list(values["stores"]), client_options(values)
