"""A tensor-parallel follower process: `python -m specserve.engine.tp_worker` (started by tp_launch.start_rank0),
or a torchrun rank other than 0 (`follow_torchrun`, from the CLI). It joins the ranks, loads the shard rank 0
names and runs rank 0's commands until rank 0 stops it or ends."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable

from specserve.engine.tp_launch import RankGroup, join_spawned, join_torchrun


def _watch_parent(parent: int) -> None:
    """End this process once its parent (rank 0) is gone, even before it joins any group (then no socket
    would tell it)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def _run(rank: int, join: Callable[[], RankGroup]) -> int:
    try:
        group = join()
        from specserve.engine.tp_runner import follow

        return follow(group)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # rank 0 ended (a closed socket) or a load failed: one line, not a traceback
        print(f"specserve tensor-parallel rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 1


def follow_torchrun(device_type: str) -> int:
    """A torchrun rank other than 0: follow torchrun's rank 0."""
    return _run(int(os.environ.get("RANK", "-1")), lambda: join_torchrun(device_type))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.engine.tp_worker")
    p.add_argument("--port", type=int, required=True, help="rank 0's TCPStore on 127.0.0.1")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--device", default="cpu", help="cpu or cuda (this rank then takes cuda:RANK)")
    p.add_argument("--parent", type=int, required=True, help="rank 0's process id")
    args = p.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(args.parent,), name="tp-parent-watch", daemon=True).start()
    return _run(args.rank, lambda: join_spawned(args.port, args.rank, args.world, args.device))


if __name__ == "__main__":
    sys.exit(main())
