"""The prefill/decode handoff protocol every kvtier vLLM adapter speaks:
kvtier's connector (:mod:`kvtier.integrations.vllm_handoff`) and its
offloading tier (:mod:`kvtier.integrations.vllm_tier_handoff`), driven by
kvtier-frontend (docs/disaggregation.md, "The protocol").

The keys are vLLM's own offloading P/D keys in a request's
``kv_transfer_params`` (vLLM's "orchestration-layer protocol", the one
llm-d's routing sidecar speaks), with kvtier's fence as a refinement:

- a **prefill** request carries ``{"remote_decoder": {"kv_request_id":
  ID}}`` (or vLLM's NIXL-style ``{"do_remote_decode": true}``, which
  routers such as vllm-router send): it computes and saves its whole
  prompt. The connector answers with ``{"remote_prefiller":
  {"kv_request_id": ID}, "kvtier": FENCE}`` (:func:`producer_params`):
  the decode request's keys, which a router passes on as they are; when
  its store did not answer, ``{"kvtier": {"not_sent": WHY}}``
  (:func:`not_sent_params`). The tier (vLLM's ``OffloadingConnector``)
  answers with nothing: the router builds the decode's keys itself.
- a **decode** request carries ``{"remote_prefiller": {"kv_request_id":
  ID}}`` and, when the prefill answered with one, its ``kvtier`` fence:
  it waits within its budget until the store holds what the prefill
  wrote (the fence's blocks, else the whole prompt), then loads it and
  computes the rest.

:func:`read_handoff` reads both sides' keys for either adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: The key of kvtier's entry in vLLM's ``kv_transfer_params``.
HANDOFF_KEY = "kvtier"


@dataclass
class Fence:
    """What a decode waits for: ``blocks`` leading blocks of the prompt in
    namespace ``namespace`` (None: the decode engine's own, when the
    prefill named none)."""

    namespace: Optional[int]
    blocks: int


@dataclass
class HandoffAsk:
    """What a request's ``kv_transfer_params`` ask of an adapter: ``role``
    "prefill", "decode" or None (an ordinary request), the router's
    ``kv_request_id`` (None when it gave none), a decode's ``fence`` (with
    the connector's block geometry), and ``problem``: what was wrong with
    keys that were ignored ("" when nothing was)."""

    role: Optional[str] = None
    kv_request_id: Optional[str] = None
    fence: Optional[Fence] = None
    problem: str = ""


def pd_role(params: Any) -> tuple[Optional[str], Optional[str], str]:
    """The role vLLM's P/D keys give a request: ``("decode", id, "")`` for
    ``remote_prefiller``, ``("prefill", id, "")`` for ``remote_decoder``,
    ``("prefill", None, "")`` for ``do_remote_decode: true``,
    ``(None, None, "")`` for none, and ``(None, None, why)`` for keys the
    protocol forbids or that are malformed (the request then runs as an
    ordinary one). ``remote_kv_source`` needs nothing of kvtier: every
    engine finds what the shared store holds by its ordinary lookups."""
    if not isinstance(params, dict):
        return None, None, ""
    pre = params.get("remote_prefiller")
    dec = params.get("remote_decoder")
    if pre is None and dec is None:
        if params.get("do_remote_decode") is True:
            return "prefill", None, ""
        return None, None, ""
    if pre is not None and (dec is not None or
                            params.get("remote_kv_source") is not None):
        return None, None, ("remote_prefiller goes alone (not with "
                            "remote_decoder or remote_kv_source)")
    key = "remote_prefiller" if pre is not None else "remote_decoder"
    value = pre if pre is not None else dec
    rid = value.get("kv_request_id") if isinstance(value, dict) else None
    if not isinstance(rid, str) or not rid:
        return None, None, (f"{key} needs a non-empty string kv_request_id "
                            f"(got {value!r:.80})")
    return ("decode" if pre is not None else "prefill"), rid, ""


def read_handoff(params: Any, prompt_tokens: int,
                 block_tokens: int) -> HandoffAsk:
    """What ``params`` ask of a request of ``prompt_tokens`` tokens on an
    engine of ``block_tokens``-token blocks: vLLM's keys decide the role; a
    decode's fence is the ``kvtier`` entry when there is one (checked
    against this prompt and geometry), else the prompt's whole blocks in
    the engine's own namespace. A ``kvtier`` fence without
    ``remote_prefiller`` makes a decode too (kvtier's earlier keys)."""
    role, rid, why = pd_role(params)
    if why:
        return HandoffAsk(problem=why)
    has_fence = isinstance(params, dict) and HANDOFF_KEY in params
    if role == "prefill" or (role is None and not has_fence):
        return HandoffAsk(role, rid)
    if not has_fence:
        return HandoffAsk("decode", rid, Fence(None,
                                               prompt_tokens // block_tokens))
    fence, bad = _read_fence(params[HANDOFF_KEY], prompt_tokens, block_tokens)
    if bad:
        return HandoffAsk(problem=bad)
    return HandoffAsk("decode", rid, fence)


def _read_fence(entry: Any, prompt_tokens: int,
                block_tokens: int) -> tuple[Optional[Fence], str]:
    """A ``kvtier`` entry's fence, or what is wrong with it."""
    if not isinstance(entry, dict):
        return None, f"kv_transfer_params.{HANDOFF_KEY} is not an object"
    if "not_sent" in entry:
        return None, (f"the prefill handed nothing on "
                      f"({str(entry['not_sent'])[:120]})")
    ns, blocks = entry.get("namespace"), entry.get("blocks")
    bt, n = entry.get("block_tokens"), entry.get("prompt_tokens")
    try:
        ns_id = int(ns, 16) if isinstance(ns, str) else -1
    except ValueError:
        ns_id = -1
    if not 0 <= ns_id < 1 << 64:
        return None, f"namespace {ns!r} is not 16 hex digits"
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        return None, f"blocks {blocks!r} is not a count"
    if bt != block_tokens:
        return None, (f"block_tokens {bt!r} differs from this engine's "
                      f"{block_tokens}")
    if n != prompt_tokens:
        return None, (f"prompt_tokens {n!r} differs from this request's "
                      f"{prompt_tokens} (another prompt's handoff)")
    if blocks * block_tokens > prompt_tokens:
        return None, f"blocks {blocks} exceed the prompt's {prompt_tokens} tokens"
    return Fence(ns_id, blocks), ""


def producer_params(namespace_id: int, blocks: int, prompt_tokens: int,
                    block_tokens: int,
                    kv_request_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a connector's finished prefill returns:
    the decode's keys (``remote_prefiller`` with ``kv_request_id``) and the
    fence: its namespace (hex), ``blocks`` (the prompt's leading blocks in
    the store or being written), the prompt's length and the block size."""
    return {"remote_prefiller": {"kv_request_id": kv_request_id},
            HANDOFF_KEY: {"namespace": f"{namespace_id:016x}",
                          "blocks": int(blocks),
                          "prompt_tokens": int(prompt_tokens),
                          "block_tokens": int(block_tokens)}}


def not_sent_params(why: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill that hands nothing on (its
    store did not answer): a router serves the request colocated."""
    return {HANDOFF_KEY: {"not_sent": why}}
