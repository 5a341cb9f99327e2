"""A real vLLM engine (vLLM's CPU build, the tiny model in tests/models,
dummy weights from a fixed seed, token-id prompts) as a process the tests
and the benchmark drive over stdin/stdout, one JSON object a line:

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8}
      -> {"outputs": [{"tokens": [...], "cached": N, "ttft": S}, ...],
          "seconds": S}
    {"op": "abort_during_load", "victim": [ids], "next": [ids],
     "flush": [ids], "store_pid": PID, "hold_s": S}
      -> {"tokens": [...], "held": B, "maps": {...}, ...}
    {"op": "abort_while_saving", "victim": [ids], "computed": N,
     "next": [ids], "store_pid": PID}
      -> {"held": B, "tokens": [...], "settled": {...}}
    {"op": "reset_prefix_cache"} -> {"reset": B}
    {"op": "stop"} -> {"stopped": true}

A generate's answer also carries vLLM's count of preemptions so far
(``"preemptions"``). ``abort_during_load`` and ``abort_while_saving``
need ``--inproc 1 --one-process 1`` (:func:`_abort_during_load`,
:func:`_abort_while_saving`). ``max_tokens`` may be a
list (one a prompt); ``"prompt_logprobs": K`` asks
vLLM for each prompt position's top K (the answer's outputs then carry
``"prompt_logprobs"``: per position, token id -> logprob, None for the
first). With ``--inproc 1`` the
engine core runs in this process (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the answer carries every
``LLMEngine.step()``'s start and duration (``"steps": [[t, s], ...]``,
``time.monotonic()`` of this process) and the tokens each scheduled
(``"step_tokens"``, in the same order), and a generate may carry
``"after_lookup"``: an action taken once, right after the first step
whose kvtier lookups the store has answered and before the step that
plans their loads (``{"stop": PID}``: SIGSTOP that process and wait until
it is stopped; ``{"run": [ARGV...]}``: run that command to its end); the
answer then says when (``"acted_at"``). With ``--one-process 1`` the
worker runs in this process too (vLLM's ``uni`` executor): an engine of
one rank then starts without spawning a process, in about a third of the
time, and kvtier's connector metadata reaches its worker half without
being serialized (the tests that need that path run without it).

It prints {"ready": true, ...} once the engine serves. ``cached`` is vLLM's
own count of prompt tokens it did not compute (its prefix cache plus the
connector's external hits); ``ttft`` vLLM's own time from the request's
arrival to its first token. With ``--stores`` kvtier is its KV connector
(``kvtier.integrations.vllm.KvtierConnector``); with ``--kv-events`` it
publishes vLLM's KV events over ZeroMQ.

    python vllm_engine.py --model DIR [--stores HOST:PORT] [--kv-events tcp://*:P]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TINY_MODEL = os.path.join(ROOT, "tests", "models", "tiny-llama")


def kv_transfer_config(stores: str, deadline_ms: int = 2000,
                       lookup_wait_ms: float = 0,
                       pin_wait_ms: float = 0,
                       staging_blocks: int = 0,
                       save_budget_ms: float = 0,
                       save_policy: str = "") -> dict[str, Any]:
    """kvtier as vLLM's KV connector, exactly as docs/engines.md gives it
    (``lookup_wait_ms``, ``pin_wait_ms``, ``staging_blocks`` and
    ``save_budget_ms`` 0, ``save_policy`` "": the connector's defaults)."""
    extra: dict[str, Any] = {"stores": stores, "deadline_ms": deadline_ms}
    if lookup_wait_ms:
        extra["lookup_wait_ms"] = lookup_wait_ms
    if pin_wait_ms:
        extra["pin_wait_ms"] = pin_wait_ms
    if staging_blocks:
        extra["staging_blocks"] = staging_blocks
    if save_budget_ms:
        extra["save_budget_ms"] = save_budget_ms
    if save_policy:
        extra["save_policy"] = save_policy
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=TINY_MODEL)
    ap.add_argument("--stores", default="")
    ap.add_argument("--deadline-ms", type=int, default=2000)
    ap.add_argument("--lookup-wait-ms", type=float, default=0,
                    help="the connector's lookup_wait_ms (0: its default)")
    ap.add_argument("--pin-wait-ms", type=float, default=0,
                    help="the connector's pin_wait_ms (0: its default)")
    ap.add_argument("--staging-blocks", type=int, default=0,
                    help="the connector's staging_blocks (0: its default)")
    ap.add_argument("--save-budget-ms", type=float, default=0,
                    help="the connector's save_budget_ms (0: its default)")
    ap.add_argument("--save-policy", default="",
                    help="the connector's save_policy (\"\": its default)")
    ap.add_argument("--connector-extra", default="",
                    help="more kv_connector_extra_config keys, as JSON")
    ap.add_argument("--kv-events", default="")
    ap.add_argument("--load-format", default="dummy",
                    help="vLLM's load_format (dummy: random weights from "
                    "the seed; auto: the model directory's weights)")
    ap.add_argument("--hf-overrides", default="",
                    help="vLLM's hf_overrides, as JSON")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--prefix-caching", type=int, default=1)
    ap.add_argument("--inproc", type=int, default=0,
                    help="1: the engine core in this process, its steps "
                    "timed (see the module docstring)")
    ap.add_argument("--one-process", type=int, default=0,
                    help="1: the engine core and its worker in this process "
                    "(VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's uni executor): "
                    "it starts in a third of the time, but the connector's "
                    "metadata then crosses no process boundary")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size (one worker process a rank)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="vLLM's max_num_batched_tokens, the tokens a step "
                    "computes at most (a longer prompt is prefilled in "
                    "chunks, one a step; 0: vLLM's default)")
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="KV blocks (vLLM's num_gpu_blocks_override; 0: "
                    "sized by VLLM_CPU_KVCACHE_SPACE)")
    args = ap.parse_args()

    # The protocol keeps the process's stdout; everything else (vLLM's logs,
    # its engine-core and worker processes) goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    # 1 GiB of KV memory (a million tokens of the tiny model), not vLLM's
    # default share of the machine's memory.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.inproc or args.one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if args.stores:
        kw["kv_transfer_config"] = kv_transfer_config(
            args.stores, args.deadline_ms, args.lookup_wait_ms,
            args.pin_wait_ms, args.staging_blocks, args.save_budget_ms,
            args.save_policy)
        if args.connector_extra:
            kw["kv_transfer_config"]["kv_connector_extra_config"].update(
                json.loads(args.connector_extra))
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.one_process:
        assert args.tp == 1, "--one-process runs one rank"
        kw["distributed_executor_backend"] = "uni"
    if args.tp > 1:
        # Ranks not bound to cores: vLLM's CPU build binds each rank's
        # threads to a core of its own by default, and with both of a
        # 2-core host's cores held by spinning ranks, beside make
        # test-busy's hogs, the store and the test waited tens of seconds
        # for a core.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kw.update(tensor_parallel_size=args.tp,
                  distributed_executor_backend="mp")
    if args.kv_events:
        kw["kv_events_config"] = {"enable_kv_cache_events": True,
                                  "publisher": "zmq",
                                  "endpoint": args.kv_events,
                                  "topic": "kv-events"}
    start = time.monotonic()
    if args.hf_overrides:
        kw["hf_overrides"] = json.loads(args.hf_overrides)
    llm = LLM(model=args.model, load_format=args.load_format,
              skip_tokenizer_init=True,
              seed=0, dtype="bfloat16", block_size=args.block_size,
              max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=bool(args.prefix_caching),
              disable_log_stats=False, **kw)
    print(json.dumps({"ready": True,
                      "start_seconds": time.monotonic() - start}),
          file=proto, flush=True)
    timed = _StepTimer(llm) if args.inproc else None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "stop":
            print(json.dumps({"stopped": True}), file=proto, flush=True)
            break
        if msg["op"] == "reset_prefix_cache":
            print(json.dumps({"reset": bool(llm.reset_prefix_cache())}),
                  file=proto, flush=True)
            continue
        if msg["op"] == "settle":
            print(json.dumps(_settle(llm, float(msg.get("timeout_s", 30)))),
                  file=proto, flush=True)
            continue
        if msg["op"] in STEPPED_OPS:
            print(json.dumps(STEPPED_OPS[msg["op"]](llm, msg)), file=proto,
                  flush=True)
            continue
        want = msg.get("max_tokens", 8)
        if not isinstance(want, list):
            want = [want] * len(msg["prompts"])
        plp = msg.get("prompt_logprobs")
        sp = [SamplingParams(max_tokens=int(n), temperature=0.0,
                             detokenize=False, ignore_eos=True,
                             prompt_logprobs=plp) for n in want]
        extra: dict[str, Any] = {}
        if timed is not None:
            timed.begin(msg.get("after_lookup"))
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p)
                             for p in msg["prompts"]], sp, use_tqdm=False)
        took = time.monotonic() - t
        if timed is not None:
            extra = timed.end()
        print(json.dumps({**extra,
            "outputs": [{"tokens": list(o.outputs[0].token_ids),
                         "cached": int(o.num_cached_tokens or 0),
                         **({"prompt_logprobs": _prompt_logprobs(o)}
                            if plp is not None else {}),
                         "ttft": float(getattr(o.metrics,
                                               "first_token_latency", 0.0)
                                       or 0.0)}
                        for o in outs],
            "seconds": took, "preemptions": _preemptions(llm)}), file=proto,
            flush=True)
    del llm


def _abort_during_load(llm: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """The ``abort_during_load`` op (an in-process engine core with its
    worker in this process, ``--one-process 1``): request ``victim`` is
    looked up; the store (pid ``store_pid``) is SIGSTOPped once the lookup
    is answered, so the victim's load stalls in flight; the victim is
    aborted and ``next`` added; after ``hold_s`` the store is SIGCONTed.
    Answers ``next``'s tokens, whether the connector still held the
    victim's pages right after the abort (``held``), the step count at
    which ``next`` was first scheduled and at SIGCONT, and every map of the
    scheduler's and the worker's connector halves once a later ``flush``
    request has run (each should be empty)."""
    from processes import sigcont, sigstop
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from kvtier.hooks import request_key

    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    conn = core.scheduler.connector
    lookups = conn._scheduler._lookups
    sp = SamplingParams(max_tokens=int(msg.get("max_tokens", 8)),
                        temperature=0.0, detokenize=False, ignore_eos=True)
    llm.reset_prefix_cache()
    # vLLM makes each id its own (a suffix): the connector sees that one.
    victim = eng.add_request(
        "victim", TokensPrompt(prompt_token_ids=msg["victim"]), sp)
    pid = int(msg["store_pid"])
    deadline = time.monotonic() + 60
    stopped = False
    key = request_key(victim)
    while victim not in conn._loading:
        eng.step()
        # The victim's lookup answered, its load not yet planned (the
        # next step plans it): the store stops before the load pins.
        if not stopped:
            with lookups._lock:  # told as each answer comes
                lookups._lock.wait_for(lambda: key in lookups._done, 5)
        if not stopped and key in lookups._done:
            sigstop(pid)
            stopped = True
        assert time.monotonic() < deadline, "the victim's load never began"
    assert stopped, "the load was planned before its lookup was seen"
    eng.abort_request(["victim"])
    eng.step()
    held = victim in conn._loading
    nxt = eng.add_request("next", TokensPrompt(prompt_token_ids=msg["next"]),
                          sp)
    tokens: list[int] = []
    steps, scheduled_at, resumed_at = 0, None, None
    t0 = time.monotonic()
    done = False
    while not done:
        if resumed_at is None and time.monotonic() - t0 >= msg["hold_s"]:
            sigcont(pid)
            resumed_at = steps
        for out in eng.step():
            if out.request_id in ("next", nxt):
                tokens = list(out.outputs[0].token_ids)
                done = out.finished
        steps += 1
        if scheduled_at is None and any(
                r.request_id == nxt for r in core.scheduler.running):
            scheduled_at = steps
        assert time.monotonic() < deadline + 60, "next never finished"
    if resumed_at is None:
        sigcont(pid)
    llm.generate([TokensPrompt(prompt_token_ids=msg["flush"])], sp,
                 use_tqdm=False)
    worker = get_kv_transfer_group()
    maps = {f"scheduler.{k}": len(getattr(conn, k)) for k in
            ("_loading", "_inflight", "_blocks", "_hashes", "_planned",
             "_computes")}
    maps["scheduler._reqs"] = len(conn._scheduler._reqs)
    for i, w in enumerate(worker._workers):
        for k in ("_loading", "_async", "_ended", "_abandoned", "_errors"):
            maps[f"worker{i}.{k}"] = len(getattr(w, k))
        # The flush request closes on the worker with the next step.
        mine = {key, request_key(nxt)} & set(w._open)
        maps[f"worker{i}._open (victim, next)"] = len(mine)
    return {"tokens": tokens, "held": held, "scheduled_at": scheduled_at,
            "resumed_at": resumed_at, "maps": maps}


def _abort_while_saving(llm: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """The ``abort_while_saving`` op (an in-process engine core with its
    worker in this process, ``--one-process 1``): the store (pid
    ``store_pid``) SIGSTOPped, request ``victim`` runs until it has
    computed ``computed`` tokens (its saves queued behind the stopped
    store: the connector's staging fills and the rest wait on the save
    lane), then is aborted. Answers whether vLLM still held the victim's
    pages for kvtier one step after the abort (``held``), then, with the
    store SIGCONTed, ``next``'s tokens and the ``settle`` op's answer."""
    from processes import sigcont, sigstop
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    conn = core.scheduler.connector
    sp = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False,
                        ignore_eos=True)
    pid = int(msg["store_pid"])
    deadline = time.monotonic() + 60
    sigstop(pid)
    try:
        # vLLM makes each id its own (a suffix): the connector sees that one.
        victim = eng.add_request(
            "victim", TokensPrompt(prompt_token_ids=msg["victim"]), sp)
        while True:
            eng.step()
            req = core.scheduler.requests.get(victim)
            if req is not None and \
                    req.num_computed_tokens >= int(msg["computed"]):
                break
            assert time.monotonic() < deadline, \
                "the victim never computed its tokens"
        eng.abort_request(["victim"])
        eng.step()
        held = victim in conn._held
    finally:
        sigcont(pid)
    outs = llm.generate([TokensPrompt(prompt_token_ids=msg["next"])], sp,
                        use_tqdm=False)
    return {"held": held, "tokens": list(outs[0].outputs[0].token_ids),
            "settled": _settle(llm, float(msg.get("timeout_s", 30)))}


#: The ops that step an in-process engine core themselves.
STEPPED_OPS = {"abort_during_load": _abort_during_load,
               "abort_while_saving": _abort_while_saving}


def _settle(llm: Any, timeout_s: float) -> dict[str, Any]:
    """The ``settle`` op (an in-process engine core, ``--one-process 1``):
    steps the engine, as vLLM's engine loop does while finished requests
    still hold pages, until its scheduler holds no request (at most
    ``timeout_s``). Answers the requests still held, the steps taken, the
    free and total KV blocks, the connector's held requests and the save
    counters of the steps taken."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    deadline = time.monotonic() + timeout_s
    steps = 0
    while sched.requests and time.monotonic() < deadline:
        llm.llm_engine.step()
        steps += 1
    pool = sched.kv_cache_manager.block_pool
    lane = get_kv_transfer_group()._lane
    return {"held": len(sched.requests), "steps": steps,
            "free_blocks": pool.get_num_free_blocks(),
            "blocks": pool.num_gpu_blocks,
            "connector_held": len(sched.connector._held),
            "saves": lane.stats() if lane is not None else {}}


def _preemptions(llm: Any) -> int:
    """vLLM's own count of preempted requests so far
    (``vllm:num_preemptions``)."""
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics()
                   if m.name == "vllm:num_preemptions"))


def _prompt_logprobs(out: Any) -> list[Optional[dict[str, float]]]:
    """vLLM's prompt logprobs of one output as plain JSON."""
    return [None if pos is None else
            {str(tok): float(lp.logprob) for tok, lp in pos.items()}
            for pos in (out.prompt_logprobs or [])]


class _StepTimer:
    """Times each ``LLMEngine.step()`` of an in-process engine core and
    takes a generate's ``after_lookup`` action (module docstring)."""

    def __init__(self, llm: Any) -> None:
        self._engine = llm.llm_engine
        self._step = self._engine.step
        self._engine.step = self._timed_step
        core = self._engine.engine_core.engine_core  # InprocClient's core
        # Each step's scheduled tokens (0: a step that computed nothing,
        # as a connector's engine makes while it waits on the connector).
        self._tokens: list[int] = []
        schedule = core.scheduler.schedule

        def counted(*a: Any, **kw: Any) -> Any:
            out = schedule(*a, **kw)
            self._tokens.append(int(out.total_num_scheduled_tokens))
            return out
        core.scheduler.schedule = counted
        conn = core.scheduler.connector  # None: vLLM alone
        self._lookups = (conn._scheduler._lookups if conn is not None
                         else None)
        self._steps: list[list[float]] = []
        self._action: Any = None
        self._acted_at: Optional[float] = None

    def begin(self, action: Any) -> None:
        self._steps, self._action, self._acted_at = [], action, None
        self._tokens = []

    def end(self) -> dict[str, Any]:
        return {"steps": self._steps, "acted_at": self._acted_at,
                "step_tokens": self._tokens}

    def _timed_step(self) -> Any:
        t = time.monotonic()
        out = self._step()
        self._steps.append([t, time.monotonic() - t])
        if self._action is not None and self._answered():
            self._act(self._action)
            self._action = None
            self._acted_at = time.monotonic()
        return out

    def _answered(self) -> bool:
        """True once a lookup is answered and not yet used: waits (5 s at
        most) for lookups out; False when none was asked."""
        lk = self._lookups
        if lk is None:
            return False
        deadline = time.monotonic() + 5
        with lk._lock:
            while lk._out or lk._pending:
                if time.monotonic() > deadline:
                    return False
                lk._lock.wait(0.01)
            return bool(lk._done)

    @staticmethod
    def _act(action: dict[str, Any]) -> None:
        import subprocess
        from processes import sigstop
        if "stop" in action:
            sigstop(int(action["stop"]))
            return
        subprocess.run(action["run"], check=True, timeout=120,
                       stdout=sys.stderr)


if __name__ == "__main__":
    main()


class Engine:
    """A vllm_engine.py process; stopped by its pid (stop())."""

    def __init__(self, log_path: str, stores: str = "",
                 kv_events: str = "", env: dict[str, str] | None = None,
                 timeout: float = 240, **flags: Any) -> None:
        import subprocess
        cmd = [sys.executable, os.path.abspath(__file__)]
        if stores:
            cmd += ["--stores", stores]
        if kv_events:
            cmd += ["--kv-events", kv_events]
        for k, v in flags.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=env, start_new_session=True)
        self.ready = self._read(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        import select
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            r, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not r:
                self.stop()
                raise TimeoutError(f"the engine did not answer in {timeout} s;"
                                   f" its log: {self.tail()}")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the engine exited: {self.tail()}")
            if line.startswith(b"{"):
                return json.loads(line)

    def tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def generate(self, prompts: list[list[int]],
                 max_tokens: int | list[int] = 8, timeout: float = 240,
                 **extra: Any) -> dict[str, Any]:
        """vLLM's greedy output of each prompt and its cached tokens
        (``extra``: more fields of the request, e.g. ``after_lookup``)."""
        return self.op("generate", timeout, prompts=prompts,
                       max_tokens=max_tokens, **extra)

    def op(self, name: str, timeout: float = 240,
           **fields: Any) -> dict[str, Any]:
        """Op ``name`` with ``fields`` (the module docstring); its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(
            {"op": name, **fields}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def abort_during_load(self, timeout: float = 240,
                          **fields: Any) -> dict[str, Any]:
        """The ``abort_during_load`` op (:func:`_abort_during_load`)."""
        return self.op("abort_during_load", timeout, **fields)

    def abort_while_saving(self, timeout: float = 240,
                           **fields: Any) -> dict[str, Any]:
        """The ``abort_while_saving`` op (:func:`_abort_while_saving`)."""
        return self.op("abort_while_saving", timeout, **fields)

    def settle(self, timeout_s: float = 30) -> dict[str, Any]:
        """The ``settle`` op (:func:`_settle`)."""
        return self.op("settle", timeout_s + 60, timeout_s=timeout_s)

    def reset_prefix_cache(self) -> bool:
        """Empties vLLM's prefix cache (vLLM's ``reset_prefix_cache``)."""
        return bool(self.op("reset_prefix_cache", 60)["reset"])

    def stop(self) -> None:
        """Asks the engine to stop; kills its process group after 60 s, and
        returns once none of the group's processes is left (fails past
        30 s)."""
        import signal
        import subprocess
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "stop"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:  # the engine core and worker processes vLLM spawned
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        # Until every process of the group is gone: one still exiting
        # (freeing gigabytes) slows whatever runs next.
        from conftest import wait_until
        self._log.close()

        def gone() -> bool:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            return False
        wait_until(gone, f"engine process group {self.proc.pid} to exit")
