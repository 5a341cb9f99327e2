"""vLLM's hybrid KV cache manager (HMA) in kvtier's connector.

A hybrid model (Gemma 2/3, gpt-oss, Mistral-style windows) has several KV
cache groups: full-attention layers in one, sliding-window layers in
another, each with its own block table (vLLM's ``SupportsHMA``). kvtier
stores each group in a namespace of its own (the group's index and kind
are part of it), under one chain of block hashes: the primary group's
(the first full-attention group), which is also the one the scheduler
looks up. A step's plan is made for the primary group by
:class:`kvtier.scheduler_half.SchedulerHalf` and carried here to the other
groups' pages, block for block:

- a load covers, in each group, the pages vLLM allocated for the loaded
  blocks; a sliding-window group's blocks before its window are vLLM's
  null block (page 0), not loaded;
- a save writes, in each group, the group's pages of the blocks the step
  filled, in runs of pages that are not the null block.

A load that fails in any group (a block that group's namespace lacks, a
checksum mismatch) fails the request: vLLM cannot take per-block errors
from a model with several groups, so it recomputes the whole request
(``failed_recving``). Group kinds kvtier cannot store are refused by name:
Mamba/SSM state (a request's state is one running value, not blocks of a
prefix), chunked local attention, cross-attention and anything else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import kvtier
from kvtier.step_plan import LoadSpec, SaveSpec, StepMeta

#: vLLM's null block: the page a group's table holds for a block it skips.
NULL_PAGE = 0


def group_kinds(kv_cache_config: Any) -> list[str]:
    """Each KV cache group's kind: ``"full"``, or ``"window=N"`` for a
    sliding window of N tokens. InvalidArgument, naming the group and its
    spec, for a kind kvtier does not store."""
    kinds = []
    for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups",
                                      None) or []):
        spec = getattr(group, "kv_cache_spec", None)
        name = type(spec).__name__
        if spec is None or name == "FullAttentionSpec":
            kinds.append("full")
        elif name == "SlidingWindowSpec":
            kinds.append(f"window={int(spec.sliding_window)}")
        else:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"KV cache group {g} is a {name}; kvtier's connector stores "
                "full-attention and sliding-window groups only (Mamba/SSM "
                "state is one running value per request, not blocks of a "
                "prefix; chunked local and cross-attention are not stored): "
                "serve this model without kvtier's KvtierConnector in "
                "kv_transfer_config")
    return kinds


def primary_group(kinds: list[str]) -> int:
    """The group whose namespace seeds the chain and is looked up: the
    first full-attention group (a load needs all of its blocks), else 0."""
    return kinds.index("full") if "full" in kinds else 0


def non_null_runs(first: int, pages: list[int]) -> list[tuple[int, list[int]]]:
    """``pages`` (of blocks ``first``, ``first + 1``, ...) split into runs
    of consecutive pages that are not the null block, each with its first
    block's index."""
    runs: list[tuple[int, list[int]]] = []
    for i, page in enumerate(pages):
        if page == NULL_PAGE:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == first + i:
            runs[-1][1].append(page)
        else:
            runs.append((first + i, [page]))
    return runs


@dataclass
class GroupPlans:
    """What the scheduler tracks per request for the groups other than the
    primary: each group's block ids, and each planned load's pages."""

    groups: int
    primary: int
    blocks: dict[str, list[list[int]]] = field(default_factory=dict)
    loads: dict[str, list[Optional[tuple[int, list[int]]]]] = field(
        default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def track(self, rid: str, key: int, block_ids: Any,
              resumed: bool = False) -> None:
        """A step's block ids of the request (a tuple, one list per group:
        the request's first ones, more, or, ``resumed``, all of them)."""
        self.names[key] = rid
        if block_ids is None:
            return
        have = self.blocks.get(rid)
        if have is None or resumed:
            self.blocks[rid] = [list(ids) for ids in block_ids]
        else:
            for g, ids in enumerate(block_ids):
                have[g].extend(ids)

    def planned_load(self, rid: str, key: int, block_ids: Any, first: int,
                     n: int) -> None:
        """The primary group loads blocks [first, first + n) of the request
        this step: each other group's pages of those blocks (``block_ids``:
        vLLM's per-group ids after allocation). A group whose pages there
        are not one run ending at the last block (which vLLM never
        allocates) gets None: the request's load fails and it is computed."""
        self.names[key] = rid
        plan: list[Optional[tuple[int, list[int]]]] = []
        for g, ids in enumerate(block_ids):
            runs = non_null_runs(first, list(ids[first:first + n]))
            if g == self.primary or not runs:
                plan.append((first, []))
            elif len(runs) == 1 and runs[0][0] + len(runs[0][1]) == first + n:
                plan.append(runs[0])
            else:
                plan.append(None)
        self.loads[rid] = plan

    def forget(self, rid: str) -> None:
        """The request is done."""
        self.blocks.pop(rid, None)
        self.loads.pop(rid, None)

    def steps(self, step: StepMeta) -> tuple[list[StepMeta], list[str]]:
        """The primary group's plan carried to every group (index = group;
        the primary's is ``step``), and the requests whose load cannot be
        planned in some group (they are reported failed)."""
        out = [step if g == self.primary else StepMeta(finished=list(
            step.finished)) for g in range(self.groups)]
        failed: list[str] = []
        for spec in step.loads:
            plan = self.loads.pop(spec.name, None) or []
            if any(p is None for p in plan):
                failed.append(spec.name)
                continue
            for g, p in enumerate(plan):
                if g != self.primary and p is not None and p[1]:
                    out[g].loads.append(LoadSpec(spec.request, spec.hashes,
                                                 p[0], p[1], spec.name))
        for save in step.saves:
            rid = self.names.get(save.request)
            ids = self.blocks.get(rid) if rid is not None else None
            if ids is None:
                continue
            n = len(save.pages)
            for g in range(self.groups):
                if g == self.primary:
                    continue
                pages = ids[g][save.first_block:save.first_block + n]
                for first, run in non_null_runs(save.first_block, pages):
                    out[g].saves.append(SaveSpec(save.request, save.hashes,
                                                 first, run))
        return out, failed


@dataclass
class GroupLoads:
    """The worker's count of a request's group loads: it has ended when
    every group's has, and failed when any group's did."""

    pending: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def expect(self, name: str, loads: int, failed: bool = False) -> None:
        """``loads`` group loads of the request started this step."""
        self.pending[name] = self.pending.get(name, 0) + loads
        if failed:
            self.failed.add(name)

    def expect_step(self, steps: list[StepMeta], failed: list[str]) -> None:
        """A step's plans of every group (and the requests whose load
        fails in some group): each request's group loads to wait for."""
        loads: dict[str, int] = {}
        for step in steps:
            for spec in step.loads:
                loads[spec.name] = loads.get(spec.name, 0) + 1
        for name in failed:
            self.expect(name, 0, failed=True)
        for name, n in loads.items():
            self.expect(name, n)

    def ended(self, name: str, failed: bool) -> None:
        """One group's load of the request ended."""
        self.pending[name] = self.pending.get(name, 1) - 1
        if failed:
            self.failed.add(name)

    def done(self) -> tuple[set[str], set[str]]:
        """Requests whose every group load ended since the last call, and
        those of them that failed (forgotten once returned)."""
        names = {n for n, left in self.pending.items() if left <= 0}
        for n in names:
            del self.pending[n]
        failed = names & self.failed
        self.failed -= names
        return names, failed
