"""The scheduler's host work at many slots, without a model: a fake runner whose steps take modelled device
time (--step-ms + --row-ms per row, e.g. the H200's table from `specserve bench`), so what differs between
speculative modes is the host's own work (planning, drafting, verifying, streaming) and the overlap.

    python benchmarks/scheduler_sim.py --clients 16,64 --modes none,ngram-suffix,ngram-simple

Each of N clients submits --requests greedy tasks one after another; a sequence's "model" continues its own
prompt (the text repeats, as code edits do), so drafts are right where they run. Prints tok/s per mode and
client count, and the scheduler thread's CPU microseconds per token (`--step-ms 0 --row-ms 0`: the host's
cost alone); writes JSON (-o, default scheduler_sim.json in the cache's benchmarks folder).
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import torch
from bench_output import output_path, print_table, write_json
from random_model import StandInTokenizer

from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Event, Failure, Result, Task
from specserve.model.batch import Batch
from specserve.model.kv_ledger import KVLedger, LedgerOnlyKV
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

VOCAB = 1000


class TimedStep:
    """A step whose "device" finishes at done_at (perf_counter seconds); row i's argmax is tokens[i]."""

    def __init__(self, tokens: list[int], done_at: float, vocab: int = VOCAB):
        self._tokens, self._done_at, self._vocab = tokens, done_at, vocab

    def wait(self) -> None:
        left = self._done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def tokens(self) -> list[int]:
        self.wait()
        return list(self._tokens)

    def logits(self) -> torch.Tensor:
        self.wait()
        out = torch.full((len(self._tokens), self._vocab), -10.0)
        out[torch.arange(len(self._tokens)), torch.tensor(self._tokens)] = 10.0
        return out


class FakeRunner(LedgerOnlyKV):
    """The Runner protocol over a KV ledger; a step's device time runs after the previous step's."""

    vocab_size = VOCAB
    file_bytes = 0

    def __init__(self, texts: list[list[int]], n_ctx: int, step_ms: float, row_ms: float):
        self.texts, self.n_seqs, self.n_ctx = texts, len(texts), n_ctx
        self.ledger = KVLedger(self.n_seqs, n_ctx, VOCAB)
        self.seq_len = self.ledger.seq_len
        self.device = torch.device("cpu")
        self.step_s, self.row_s = step_ms / 1e3, row_ms / 1e3
        self._free_at = 0.0

    def launch(self, batch: Batch, fed: list[int] | None = None, logits: bool = True) -> TimedStep:
        self.ledger.admit(batch, fed)
        text_of = self.texts
        tokens = [text_of[batch.seq_ids[i]][(batch.positions[i] + 1) % len(text_of[batch.seq_ids[i]])]
                  for i in batch.logit_rows()]
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + self.step_s + self.row_s * len(batch)
        return TimedStep(tokens, self._free_at)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.launch(batch).logits()

    def draft_limit(self, n_max: int) -> int:
        return min(n_max, 15)  # a verify step within 16 rows, as packed weights on CUDA

    def warmup(self, max_rows: int = 17, prompt_rows: int = 512, sequences: int = 0, trees: int = 0) -> None:
        pass

    def memory_info(self) -> dict[str, int]:
        return {"weights_bytes": 0, "kv_bytes": 0}


def run(mode: str, clients: int, requests: int, n_predict: int, step_ms: float, row_ms: float) -> tuple[float, float]:
    """(tok/s, CPU microseconds of the scheduler's thread per generated token: its host work, less noisy than
    the wall time on a busy box)"""
    rng = random.Random(0)
    base = [rng.randrange(VOCAB) for _ in range(300)]
    texts = [base[i:] + base[:i] for i in range(clients)]
    runner = FakeRunner(texts, 2048, step_ms, row_ms)
    spec = SpecParams(type=mode) if mode != "none" else SpecParams(n_max=0)
    sched = Scheduler(runner, StandInTokenizer(), chain_factory=lambda s, slot: build_chain(s, None, seq=slot))
    cpu = [0.0, 0.0]  # the loop thread's CPU time at its first and latest turn

    def note_cpu() -> None:
        cpu[1] = time.thread_time()
        cpu[0] = cpu[0] or cpu[1]

    sched.after_turn = note_cpu
    sched.start()

    def client(i: int) -> None:
        for _ in range(requests):
            done = threading.Event()

            def emit(event: Event, done: threading.Event = done) -> None:
                if isinstance(event, Result | Failure):
                    done.set()

            task = Task(texts[i][:200], SamplingParams(temperature=0.0), spec, n_predict=n_predict, ignore_eos=True)
            sched.submit(task, emit)
            done.wait()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    sched.shutdown()
    tokens = clients * requests * n_predict
    return tokens / wall, (cpu[1] - cpu[0]) / tokens * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="16,64")
    ap.add_argument("--modes", default="none,ngram-suffix,ngram-simple")
    ap.add_argument("--requests", type=int, default=3, help="tasks per client")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=1.1, help="device time of a step (H200, 1.5B Q4_K_M: 1.1)")
    ap.add_argument("--row-ms", type=float, default=0.02, help="device time per row of a step")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        for mode in args.modes.split(","):  # modes side by side at each level: load changes hit both alike
            tok_s, us = run(mode, clients, args.requests, args.n_predict, args.step_ms, args.row_ms)
            rows.append({"mode": mode, "clients": clients, "tok_s": round(tok_s, 1),
                         "sched_us_per_token": round(us, 2)})
    print_table(rows, ["mode", "clients", "tok_s", "sched_us_per_token"])
    write_json(output_path(args.output, "scheduler_sim.json"), {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
