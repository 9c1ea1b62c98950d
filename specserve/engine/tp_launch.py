"""The ranks of a tensor-parallel model: their torch.distributed groups, and the follower processes.

Two ways in. From the plain CLI (`--tensor-parallel N`), the process is rank 0: it opens a TCPStore on a
free loopback port and starts N-1 followers, `python -m specserve.engine.tp_worker`, which join through it.
Under torchrun (its RANK / WORLD_SIZE / MASTER_ADDR in the environment), every process is started by
torchrun, on one node or several, and all join torchrun's rendezvous (`env://`); rank 0 runs the command,
the others follow (cli/__init__.py sends them to `tp_worker.follow_torchrun`).

Two groups. The model's collectives run on the default group: gloo on CPU, NCCL on CUDA (one GPU a rank,
cuda:LOCAL_RANK). Rank 0's commands to the followers (tp_runner.py) go over a second group, always gloo:
they are a few host integers, which NCCL would have to stage on the device, and a follower waits on them
for as long as the server is idle, so that group's timeout is years, not the collectives' minutes. A rank
that dies closes its sockets, and a gloo peer blocked on it fails at once ("Connection closed by peer").

The environment passes to the followers unchanged: NCCL's settings (NCCL_NVLS_ENABLE=0 where NVLink
multicast must stay off, NCCL_SOCKET_IFNAME, ...) and OMP_WAIT_POLICY reach every rank as the user set
them; nothing here sets any. Each rank runs cores / (ranks on this node) torch threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.errors import SpecserveError

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one all-reduce or all-gather of a step, or joining the group
COMMAND_TIMEOUT = timedelta(days=3650)  # a follower waiting for rank 0's next command: no limit in practice
START_TIMEOUT = 300.0  # seconds for a spawned follower to start Python and torch and reach the store
READY_KEY = "specserve_tp_ready_{rank}"


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int


def torchrun_env() -> TorchrunEnv | None:
    """The rank this process has under torchrun (its environment variables), or None outside it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return TorchrunEnv(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                       int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, local_rank: int, local_world: int) -> torch.device:
    """cuda:LOCAL_RANK on CUDA (one GPU a rank), else the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    if torch.cuda.device_count() < local_world:
        raise SpecserveError(f"--tensor-parallel: {local_world} ranks on this node need as many GPUs, "
                             f"{torch.cuda.device_count()} visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def set_rank_threads(local_world: int) -> None:
    """Share this node's cores among its ranks (each would otherwise start a thread per core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world))


class DistCollectives:
    """model.tp_transformer.Collectives on a torch.distributed group."""

    def __init__(self, world: int, group: dist.ProcessGroup | None = None):
        self.world = world
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass
class RankGroup:
    """This process's place among the ranks and its groups; on a rank 0 that spawned its followers, their
    processes too."""

    rank: int
    world: int
    device: torch.device
    control: dist.ProcessGroup  # gloo: rank 0's commands, spec and load status
    comm: DistCollectives = field(init=False)
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.comm = DistCollectives(self.world)

    def exited_followers(self) -> list[str]:
        """'rank R (exit code C)' for each spawned follower that has ended."""
        return [f"rank {i + 1} (exit code {p.returncode})" for i, p in enumerate(self.followers)
                if p.poll() is not None]

    def stop_followers(self, grace: float = 10.0) -> None:
        """Wait up to `grace` seconds for the spawned followers to end, then end them (SIGTERM, then SIGKILL)."""
        deadline = time.monotonic() + grace
        for p in self.followers:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.followers:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(backend: str, rank: int, world: int, device: torch.device, **init: object) -> RankGroup:
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT, **init)  # type: ignore[arg-type]
    control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return RankGroup(rank, world, device, control)


def start_rank0(world: int, device_type: str) -> RankGroup:
    """Rank 0 of `world` ranks: torchrun's when under it (its WORLD_SIZE must be `world`), else with world - 1
    followers started here."""
    if dist.is_initialized():
        raise SpecserveError("--tensor-parallel: this process already belongs to a torch.distributed group")
    env = torchrun_env()
    if env is not None:
        if env.world != world:
            raise SpecserveError(f"--tensor-parallel {world} under torchrun with {env.world} processes: give "
                                 f"torchrun as many (--nproc-per-node times --nnodes)")
        if env.rank != 0:
            raise SpecserveError("only torchrun's rank 0 runs the command; the others follow it")
        set_rank_threads(env.local_world)
        device = rank_device(device_type, env.local_rank, env.local_world)
        return _join(backend_for(device_type), 0, world, device, init_method="env://")
    set_rank_threads(world)
    device = rank_device(device_type, 0, world)
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    followers = [subprocess.Popen([sys.executable, "-m", "specserve.engine.tp_worker", f"--port={store.port}",
                                   f"--rank={r}", f"--world={world}", f"--device={device_type}",
                                   f"--parent={os.getpid()}"]) for r in range(1, world)]
    try:
        _wait_ready(store, followers)
        group = _join(backend_for(device_type), 0, world, device, store=store)
    except BaseException:
        for p in followers:
            p.kill()
            p.wait()
        raise
    group.followers = followers
    return group


def _wait_ready(store: dist.TCPStore, followers: list[subprocess.Popen[bytes]]) -> None:
    """Until every follower has reached the store; a clear error if one ends first (instead of the group's
    join waiting out its timeout)."""
    deadline = time.monotonic() + START_TIMEOUT
    waiting = {r: p for r, p in enumerate(followers, start=1)}
    while waiting:
        for r, p in list(waiting.items()):
            if store.check([READY_KEY.format(rank=r)]):
                del waiting[r]
            elif p.poll() is not None:
                raise SpecserveError(f"--tensor-parallel: rank {r} exited with code {p.returncode} while starting")
        if time.monotonic() > deadline:
            raise SpecserveError(f"--tensor-parallel: ranks {sorted(waiting)} did not start in {START_TIMEOUT:g} s")
        time.sleep(0.05)


def join_spawned(port: int, rank: int, world: int, device_type: str) -> RankGroup:
    """A follower started by start_rank0: reach its store on loopback, say so, join."""
    set_rank_threads(world)
    device = rank_device(device_type, rank, world)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=COLLECTIVE_TIMEOUT)
    store.set(READY_KEY.format(rank=rank), "1")
    return _join(backend_for(device_type), rank, world, device, store=store)


def join_torchrun(device_type: str) -> RankGroup:
    """A follower started by torchrun."""
    env = torchrun_env()
    assert env is not None
    set_rank_threads(env.local_world)
    device = rank_device(device_type, env.local_rank, env.local_world)
    return _join(backend_for(device_type), env.rank, env.world, device, init_method="env://")
