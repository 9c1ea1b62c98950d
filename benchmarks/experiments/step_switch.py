"""Experiment (kernel_notes.md v13, rejected): verify steps launched before the host knows them.

A StepSwitch is one graph launched (armed) while the step before it still runs: a one-thread gate
kernel that waits until the host releases it through pinned memory (a ticket, the body's index), then
a switch node (CUDA 12.8+ conditional node) whose bodies are copies of the step graphs (captured with
keep_graph), then a kernel that writes the ticket to pinned memory for a host that polls. A gate that
waits longer than TIMEOUT_NS gives up and runs no body. The host's release is two stores; the launch
itself (cuGraphLaunch of ~250 nodes) leaves the path between a result and the next step.

Random weights in the Q4_K_M layout. A loop of verify steps whose row counts change from step to step
(ROW_CYCLE), the host reading each step's argmax before it launches the next, as generate() does:

  runner  LocalRunner.step_argmax(...).read(): write the inputs, replay the step's graph, wait (main)
  switch  the next launch of a StepSwitch is armed while the step before it runs; the host writes the
          inputs, releases it (two stores) and waits
and, with nothing to wait for, steps back to back: plain replays against releases of a switch armed
ahead (what a switch costs the GPU per step: the gate kernel and the switch's launch of its body).

Rounds of each variant in turn; medians over rounds of wall us per step, and the idle per step (wall
minus the GPU time of the same steps replayed back to back). Checks that both give the same argmax.
Writes JSON to $OUT/step_switch.json. Run on a CUDA machine: python benchmarks/experiments/step_switch.py
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402

U64 = ctypes.c_uint64
PTR = ctypes.c_void_p

# Argument types of the entry points used here (their exported names: cuda.h maps the unversioned
# API names to these).
_SIGNATURES: dict[str, list[Any]] = {
    "cuCtxGetCurrent": [ctypes.POINTER(PTR)],
    "cuGraphCreate": [ctypes.POINTER(PTR), ctypes.c_uint],
    "cuGraphDestroy": [PTR],
    "cuGraphConditionalHandleCreate": [ctypes.POINTER(U64), PTR, PTR, ctypes.c_uint, ctypes.c_uint],
    "cuGraphAddKernelNode_v2": [ctypes.POINTER(PTR), PTR, ctypes.POINTER(PTR), ctypes.c_size_t, PTR],
    "cuGraphAddChildGraphNode": [ctypes.POINTER(PTR), PTR, ctypes.POINTER(PTR), ctypes.c_size_t, PTR],
    "cuGraphAddNode_v2": [ctypes.POINTER(PTR), PTR, ctypes.POINTER(PTR), PTR, ctypes.c_size_t, PTR],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(PTR), PTR, ctypes.c_ulonglong],
    "cuGraphExecDestroy": [PTR],
    "cuGraphUpload": [PTR, PTR],
    "cuGraphLaunch": [PTR, PTR],
}


@functools.cache
def _entry(name: str) -> Any:
    fn = getattr(torch.cuda._utils._get_gpu_runtime_library(), name)
    fn.argtypes = _SIGNATURES[name]
    fn.restype = ctypes.c_int
    return fn


def call(name: str, *args: Any) -> None:
    """Call a driver entry point; a CUDA error raises RuntimeError naming it."""
    err = _entry(name)(*args)
    if err != 0:
        raise RuntimeError(f"{name} failed with CUDA error {err}")


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", PTR), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.POINTER(PTR)), ("extra", PTR),
                ("kern", PTR), ("ctx", PTR)]


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", U64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("graphs_out", ctypes.POINTER(PTR)), ("ctx", PTR)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: a type, then a 232-byte union
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("conditional", _ConditionalParams),
                ("pad", ctypes.c_char * (232 - ctypes.sizeof(_ConditionalParams))), ("reserved2", ctypes.c_longlong)]


NODE_CONDITIONAL = 13  # CU_GRAPH_NODE_TYPE_CONDITIONAL
COND_SWITCH = 2  # CU_GRAPH_COND_TYPE_SWITCH
COND_ASSIGN_DEFAULT = 1  # CU_GRAPH_COND_ASSIGN_DEFAULT: every launch starts from the default value


class Graph:
    """A graph built node by node; every node added depends on the one added before it."""

    def __init__(self) -> None:
        self.handle = PTR()
        call("cuGraphCreate", ctypes.byref(self.handle), 0)
        self._ctx = PTR()
        call("cuCtxGetCurrent", ctypes.byref(self._ctx))
        self._last: PTR | None = None
        self._keep: list[Any] = []  # kernel arguments and the like, alive as long as the graph

    def _deps(self) -> tuple[Any, int]:
        return (ctypes.byref(self._last), 1) if self._last is not None else (None, 0)

    def _added(self, node: PTR) -> None:
        self._last = node

    def conditional_handle(self, default: int) -> int:
        handle = U64()
        call("cuGraphConditionalHandleCreate", ctypes.byref(handle), self.handle, self._ctx, default,
             COND_ASSIGN_DEFAULT)
        return handle.value

    def add_kernel(self, func: PTR, args: list[Any]) -> None:
        """One block of one thread running func(*args) (args: ctypes values)."""
        self._keep.append(args)
        params = (PTR * len(args))(*[ctypes.cast(ctypes.byref(a), PTR) for a in args])
        self._keep.append(params)
        node_params = _KernelNodeParams(func=func, grid=(1, 1, 1), block=(1, 1, 1), params=params)
        node = PTR()
        call("cuGraphAddKernelNode_v2", ctypes.byref(node), self.handle, *self._deps(), ctypes.byref(node_params))
        self._added(node)

    def add_switch(self, handle: int, bodies: list[int]) -> None:
        """A switch node on `handle` running bodies[value] (a copy of that graph; none past the last)."""
        params = _NodeParams(type=NODE_CONDITIONAL,
                             conditional=_ConditionalParams(handle=handle, type=COND_SWITCH, size=len(bodies),
                                                            ctx=self._ctx))
        node = PTR()
        deps, n = self._deps()
        call("cuGraphAddNode_v2", ctypes.byref(node), self.handle, deps, None, n, ctypes.byref(params))
        self._added(node)
        for i, body in enumerate(bodies):
            child = PTR()
            call("cuGraphAddChildGraphNode", ctypes.byref(child), params.conditional.graphs_out[i], None, 0,
                 PTR(body))

    def instantiate(self, stream: int) -> GraphExec:
        return GraphExec(self, stream)

    def __del__(self) -> None:
        if self.handle:
            _entry("cuGraphDestroy")(self.handle)


class GraphExec:
    """An instantiated Graph, uploaded to the device, launched on a stream."""

    def __init__(self, graph: Graph, stream: int):
        self.graph = graph  # the kernel arguments it keeps must outlive this
        self.handle = PTR()
        call("cuGraphInstantiateWithFlags", ctypes.byref(self.handle), graph.handle, 0)
        call("cuGraphUpload", self.handle, PTR(stream))

    def launch(self, stream: int) -> None:
        call("cuGraphLaunch", self.handle, PTR(stream))

    def __del__(self) -> None:
        if self.handle:
            _entry("cuGraphExecDestroy")(self.handle)


SLOTS = 4  # releases and reports the host may be ahead by (at most two launches are in flight)
TIMEOUT_NS = 200_000_000
FIELDS = 5  # a release: body index, restart flag, then (token, position, sequence) for a restart

GATE_SOURCE = r"""
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Ticket t (tickets served so far + 1) waits until the host's ticket (release[0]) reaches it, then
// runs the body its slot names; a restart also sets the chained steps' state (token, position, seq).
// served[2 * slot]: the ticket and the body run (-1: none, the wait timed out), for the host to check.
extern "C" __global__ void step_gate(unsigned long long handle, const volatile long long* release,
                                     long long* count, volatile long long* served, long long* state,
                                     long long timeout_ns, int n_bodies) {
    const long long t = count[0] + 1;
    const int s = (int)(t % __SLOTS__);
    long long body = -1;
    const unsigned long long start = now_ns();
    do {
        if (release[0] >= t) {
            __threadfence_system();
            const volatile long long* slot = release + 1 + __FIELDS__ * s;
            body = slot[0];
            if (slot[1] && state) {
                state[0] = slot[2];
                state[1] = slot[3];
                state[2] = slot[4];
            }
            break;
        }
    } while (now_ns() - start < (unsigned long long)timeout_ns);
    count[0] = t;
    served[2 * s] = t;
    served[2 * s + 1] = body;
    __threadfence_system();
    cudaGraphSetConditional(handle, body < 0 ? (unsigned)n_bodies : (unsigned)body);
}

// After the body: its ticket, for a host that polls rather than waiting on an event.
extern "C" __global__ void step_done(const long long* count, volatile long long* finished) {
    finished[0] = count[0];
    __threadfence_system();
}
"""


@functools.cache
def _kernel(device: int, name: str) -> object:
    torch.cuda.set_device(device)
    source = GATE_SOURCE.replace("__SLOTS__", str(SLOTS)).replace("__FIELDS__", str(FIELDS))
    return torch.cuda._compile_kernel(source, name)


class StepSwitch:
    """One graph that runs whichever of `bodies` (raw cudaGraph_t handles of captured step graphs) the
    host names after launching it. state: the chained steps' [3, 1] (token, position, seq) on the device
    that a release may set (None: none)."""

    def __init__(self, device: torch.device, bodies: Sequence[int], state: torch.Tensor | None = None):
        self.device = device
        self.n_bodies = len(bodies)
        self._release = torch.zeros(1 + FIELDS * SLOTS, dtype=torch.long, pin_memory=True)
        self._release_np = self._release.numpy()
        self._served = torch.zeros(2 * SLOTS, dtype=torch.long, pin_memory=True)
        self._served_np = self._served.numpy()
        self._count = torch.zeros(1, dtype=torch.long, device=device)
        self._finished = torch.zeros(1, dtype=torch.long, pin_memory=True)
        self._finished_np = self._finished.numpy()
        self._state = state
        index = device.index if device.index is not None else torch.cuda.current_device()
        graph = Graph()
        handle = graph.conditional_handle(default=self.n_bodies)
        ptr = PTR
        graph.add_kernel(_kernel(index, "step_gate").func, [  # type: ignore[attr-defined]
            U64(handle), ptr(self._release.data_ptr()), ptr(self._count.data_ptr()),
            ptr(self._served.data_ptr()), ptr(state.data_ptr() if state is not None else 0),
            ctypes.c_longlong(TIMEOUT_NS), ctypes.c_int(self.n_bodies)])
        graph.add_switch(handle, list(bodies))
        graph.add_kernel(_kernel(index, "step_done").func,  # type: ignore[attr-defined]
                         [ptr(self._count.data_ptr()), ptr(self._finished.data_ptr())])
        self._exec = graph.instantiate(self._stream())
        self._events = [torch.cuda.Event() for _ in range(SLOTS)]
        self.armed = 0  # launches so far
        self.released = 0  # of which released

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    @property
    def waiting(self) -> bool:
        """A launch waits for its release (the stream is blocked behind it until then)."""
        return self.armed > self.released

    def arm(self) -> None:
        """Launch the switch behind the work queued so far; its gate waits for the next release."""
        assert self.armed - self.released < SLOTS - 1
        self._exec.launch(self._stream())
        self._events[self.armed % SLOTS].record()
        self.armed += 1

    def release(self, body: int, restart: tuple[int, int, int] | None = None) -> int:
        """Run `body` (n_bodies: none) in the oldest launch not yet released, after setting the chained
        steps' state to restart (token, position, seq) if given. Returns its ticket (for `done`)."""
        assert self.waiting and 0 <= body <= self.n_bodies
        ticket = self.released + 1
        s = ticket % SLOTS
        slot = self._release_np[1 + FIELDS * s:1 + FIELDS * (s + 1)]
        slot[0], slot[1] = body, restart is not None
        if restart is not None:
            slot[2:] = restart
        self._release_np[0] = ticket  # last: the gate reads the slot once it sees the ticket
        self.released = ticket
        return ticket

    def event(self, ticket: int) -> torch.cuda.Event:
        """Recorded after the launch that serves `ticket` (valid until SLOTS later launches)."""
        return self._events[(ticket - 1) % SLOTS]

    def poll(self, ticket: int, spins: int = 1_000_000) -> None:
        """Wait for the launch serving `ticket` by reading its pinned flag (no driver call), then by
        its event if that takes more than `spins` reads."""
        finished = self._finished_np
        for _ in range(spins):
            if finished[0] >= ticket:
                return
        self.event(ticket).synchronize()

    def ran(self, ticket: int, body: int) -> bool:
        """After event(ticket): whether that launch ran `body` (False: its gate timed out first)."""
        s = 2 * (ticket % SLOTS)
        return int(self._served_np[s]) == ticket and int(self._served_np[s + 1]) == body

    def disarm(self) -> None:
        """Release every waiting launch with no body (before other work goes into the stream)."""
        while self.waiting:
            self.release(self.n_bodies)


BASE, STEPS, ROUNDS = 600, 240, 7
ROW_CYCLE = (6, 3, 8, 2, 5, 4, 7, 2)
MAX_ROWS = 16


def tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + 3 + salt) % kb.CFG.vocab_size for i in range(n)]


def write_inputs(runner, n: int, salt: int) -> object:  # noqa: ANN001 - LocalRunner; returns its StepGraph
    step = runner.graphs.graphs[(n, False)]
    host = step.inputs.write()
    host[0, :n] = tokens(n, salt)
    host[1, :n] = range(BASE, BASE + n)
    host[2, :] = 0
    host[2, n:] = runner.graphs.pad_seq
    host[0:2, n:] = 0
    return step


def loop_runner(runner) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    out = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(STEPS):
        n = ROW_CYCLE[i % len(ROW_CYCLE)]
        out.append(runner.step_argmax(0, tokens(n, i), BASE).read())
        runner.kv_truncate(0, BASE)
    return (time.perf_counter() - t0) / STEPS * 1e6, out


def release_and_wait(switch: StepSwitch, body: int, poll: bool) -> int:
    """Release the armed launch to run `body`, arm the next one, wait for the first; its ticket."""
    ticket = switch.release(body)
    switch.arm()
    if poll:
        switch.poll(ticket)
    else:
        switch.event(ticket).synchronize()
    return ticket


def loop_switch(runner, switch: StepSwitch, poll: bool = False) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    out = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    switch.arm()
    for i in range(STEPS):
        n = ROW_CYCLE[i % len(ROW_CYCLE)]
        step = write_inputs(runner, n, i)
        assert switch.ran(release_and_wait(switch, n - 1, poll), n - 1)
        out.append(step.argmax[:n].tolist())
    switch.disarm()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS * 1e6, out


def loop_bare(runner, switch: StepSwitch | None, poll: bool = False, n: int = 4) -> float:  # noqa: ANN001
    """Wall us per step of one step graph, the host waiting for each before launching the next and doing
    nothing else: a replay and its event, or a release of a switch armed ahead, waited by event or poll."""
    step = write_inputs(runner, n, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if switch is not None:
        switch.arm()
    for _ in range(STEPS):
        if switch is None:
            step.inputs.replay(step.graph)
            step.inputs.done.synchronize()
            continue
        release_and_wait(switch, n - 1, poll)
    if switch is not None:
        switch.disarm()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS * 1e6


def back_to_back_gpu_us(runner, switch: StepSwitch | None, n: int = 4, steps: int = 100) -> float:  # noqa: ANN001
    """GPU us per step of n rows, steps queued back to back (replays, or releases of armed launches)."""
    step = write_inputs(runner, n, 0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        if switch is None:
            step.graph.replay()
        else:
            switch.arm()
            switch.release(n - 1)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / steps


def main() -> None:
    os.environ["SPECSERVE_QUANT_KERNEL"] = "mma"
    # the step graphs keep their cudaGraph_t (the switch's bodies are copies of them)
    torch.cuda.CUDAGraph = functools.partial(torch.cuda.CUDAGraph, keep_graph=True)  # type: ignore[misc]
    runner = kb.make_runner("gguf_like")
    runner.warmup(MAX_ROWS, prompt_rows=0)
    gpu = kb.step_gpu_us(runner, tuple(sorted(set(ROW_CYCLE))), BASE)  # leaves BASE tokens in sequence 0
    gpu_per_step = statistics.mean(gpu[ROW_CYCLE[i % len(ROW_CYCLE)]] for i in range(STEPS))
    t0 = time.perf_counter()
    bodies = [runner.graphs.graphs[(r, False)].graph.raw_cuda_graph() for r in range(1, MAX_ROWS + 1)]
    switch = StepSwitch(runner.device, bodies)
    build_s = time.perf_counter() - t0
    _, ref = loop_runner(runner)
    _, got = loop_switch(runner, switch)
    assert ref == got, "the switch's steps gave other tokens"
    assert loop_switch(runner, switch, poll=True)[1] == ref, "the switch's steps (polled) gave other tokens"
    rounds: dict[str, list[float]] = {"runner": [], "switch": [], "switch_poll": []}
    bare: dict[str, list[float]] = {"replay": [], "switch": [], "switch_poll": []}
    for _ in range(ROUNDS):
        rounds["runner"].append(loop_runner(runner)[0])
        rounds["switch"].append(loop_switch(runner, switch)[0])
        rounds["switch_poll"].append(loop_switch(runner, switch, poll=True)[0])
        bare["replay"].append(loop_bare(runner, None) - gpu[4])
        bare["switch"].append(loop_bare(runner, switch) - gpu[4])
        bare["switch_poll"].append(loop_bare(runner, switch, poll=True) - gpu[4])
    b2b = {"replay": [], "switch": []}
    for _ in range(ROUNDS):
        b2b["replay"].append(back_to_back_gpu_us(runner, None))
        b2b["switch"].append(back_to_back_gpu_us(runner, switch))
    out = {"rows": ROW_CYCLE, "steps": STEPS, "rounds": ROUNDS, "gpu_us_by_rows": gpu,
           "gpu_us_per_step": round(gpu_per_step, 1), "switch_build_s": round(build_s, 2), "variants": {},
           "back_to_back_4_rows_us": {k: round(statistics.median(v), 1) for k, v in b2b.items()}}
    for name, walls in rounds.items():
        wall = statistics.median(walls)
        out["variants"][name] = {"wall_us": round(wall, 1), "idle_us": round(wall - gpu_per_step, 1),  # type: ignore[index]
                                 "idle_us_rounds": [round(w - gpu_per_step, 1) for w in walls]}
        print(f"{name:7s}", json.dumps(out["variants"][name]), flush=True)  # type: ignore[index]
    out["bare_idle_us"] = {k: round(statistics.median(v), 1) for k, v in bare.items()}
    print("bare loops, 4 rows, idle us a step:", out["bare_idle_us"])
    print("back to back, 4 rows, GPU us a step:", out["back_to_back_4_rows_us"], "build s:", out["switch_build_s"])
    Path(os.environ.get("OUT", "/tmp"), "step_switch.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
