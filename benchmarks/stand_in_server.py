"""`specserve serve`'s app over a timed stand-in runner: the server's host costs without a GPU.

    python benchmarks/stand_in_server.py --port 8123 --slots 4 --step-ms 1.07 &
    python benchmarks/serve_bench.py --url http://127.0.0.1:8123 --clients 1 --modes none,ngram-suffix \
        --category code_edit

The runner's steps take modelled device time (--step-ms + --row-ms a row, after the previous step, as a
GPU queue would: the H200's 1.5B Q4_K_M numbers by default; --context-us adds a row's attention, per 1,000
positions before it, for mixes of long prompts), and its "model" continues each sequence's own
prompt, except at about one position in eight (--miss), where it writes a newline: ngram-suffix's drafts are
then accepted about as often as on the code edits (44% here, 53% on the H200 with the real model).
--host-us of Python and --release-us of GIL-free time per launch stand for the real runner's host work and
graph replay. Tokenizer, chat template, scheduler, speculators, HTTP and streaming are the product's own
(smollm2-135m's tokenizer).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import uvicorn
from scheduler_sim import FakeRunner, TimedStep

from specserve import catalog
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.model.kv_ledger import KVLedger
from specserve.model.registry import read_config
from specserve.server.app import create_app
from specserve.server.core_client import CoreClient
from specserve.server.engine import Engine, ServerSettings


class PromptEchoRunner(FakeRunner):
    """scheduler_sim's timed runner, with a vocabulary and a "model" that gives row i the token after its position
    in its sequence's prompt (cyclically), a newline at about `miss` of the positions, never a control token."""

    file_bytes = 1

    def __init__(self, gguf: GGUFFile, n_seqs: int, n_ctx: int, vocab: int, args: argparse.Namespace):
        super().__init__([[] for _ in range(n_seqs)], n_ctx, args.step_ms, args.row_ms)
        self.gguf, self.vocab_size = gguf, vocab
        self.config = read_config(gguf.metadata, set(gguf.tensor_names()))  # what the front's ModelFacts reads
        self.ledger = KVLedger(n_seqs, n_ctx, vocab)
        self.seq_len = self.ledger.seq_len
        self.dtype, self.weight_format, self.max_step_rows = torch.float32, "float", None
        self.host_s, self.release_s, self.miss, self.newline = (args.host_us / 1e6, args.release_us / 1e6,
                                                                args.miss, args.newline)
        self.context_s = args.context_us / 1e6
        self.history = [[0] * n_ctx for _ in range(n_seqs)]
        self.prompt_len = [0] * n_seqs
        self._previous: dict[int, int] = {}  # row -> argmax of the step launched last (fed rows read it)
        self._at_slot: dict[int, int] = {}  # pool slot -> the token written there (what cached blocks hold)

    def _next(self, seq: int, pos: int) -> int:
        token = self.history[seq][(pos + 1) % self.prompt_len[seq]]
        hit = (pos * 2654435761) % 1000 >= 1000 * self.miss  # a fixed pseudo-random share of the positions
        return token if hit and token > 16 else self.newline

    def launch(self, batch: Batch, fed: list[int] | None = None, logits: bool = True) -> TimedStep:
        admitted = self.ledger.admit(batch, fed)
        slots, size = admitted.slots, self.ledger.blocks.block_size
        for src, dst in admitted.copies:  # copy on write, as the device copies K/V
            for i in range(size):
                if src * size + i in self._at_slot:
                    self._at_slot[dst * size + i] = self._at_slot[src * size + i]
        busy_until = time.perf_counter() + self.host_s
        while time.perf_counter() < busy_until:  # host work that holds the GIL
            pass
        if self.release_s:
            time.sleep(self.release_s)  # and a GIL-free stretch (a graph replay)
        tokens, by_row = [], {}
        for i, token in enumerate(batch.tokens):
            seq, pos = batch.seq_ids[i], batch.positions[i]
            if fed is not None and fed[i] >= 0:
                token = self._previous[fed[i]]
            self.history[seq][pos] = self._at_slot[slots[i]] = token
            if pos == 0:
                self.prompt_len[seq] = 0
            if batch.want_logits[i]:
                self.prompt_len[seq] = self.prompt_len[seq] or pos + 1
                by_row[i] = self._next(seq, pos)
                tokens.append(by_row[i])
        self._previous = by_row
        attention = self.context_s * sum(batch.positions) / 1000 if self.context_s else 0.0
        self._free_at = max(time.perf_counter(), self._free_at) + self.step_s + self.row_s * len(batch) + attention
        return TimedStep(tokens, self._free_at, self.vocab_size)

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        """The tokens of the blocks taken become the sequence's history (its prompt's start)."""
        n = super().kv_attach(seq, names)
        for pos, slot in enumerate(self.ledger.blocks.slots(seq, 0, n)):
            self.history[seq][pos] = self._at_slot[slot]
        self.prompt_len[seq] = 0
        return n


def stand_in_runner(args: argparse.Namespace, settings: ServerSettings) -> tuple[PromptEchoRunner, None, Path]:
    """The engine core's loader: the stand-in runner over smollm2-135m's vocabulary."""
    path = Path(settings.model or catalog.resolve("smollm2-135m"))
    gguf = GGUFFile(path)
    vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    return PromptEchoRunner(gguf, args.slots, args.ctx, vocab, args), None, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048, help="positions per slot")
    ap.add_argument("--step-ms", type=float, default=1.07, help="device time of a step")
    ap.add_argument("--row-ms", type=float, default=0.0137, help="device time per row of a step")
    ap.add_argument("--context-us", type=float, default=0.0,
                    help="device time per row per 1,000 positions it attends (5.2 fits the H100's long-prompt steps)")
    ap.add_argument("--host-us", type=float, default=0.0, help="Python time per launch, holding the GIL")
    ap.add_argument("--release-us", type=float, default=0.0, help="GIL-free time per launch")
    ap.add_argument("--miss", type=float, default=0.12, help="share of positions where the model leaves the prompt")
    ap.add_argument("--newline", type=int, default=198, help="the token written there")
    ap.add_argument("--draft-policy", choices=("adaptive", "gated", "always"), default="adaptive",
                    help="as `specserve serve --draft-policy`")
    ap.add_argument("--core-process", action="store_true",
                    help="the scheduler in an engine core process of its own, as `specserve serve` runs it (default: "
                         "a thread of this process, as --core-in-process)")
    args = ap.parse_args()
    path = catalog.resolve("smollm2-135m")
    settings = ServerSettings(model=str(path), n_parallel=args.slots, adaptive_drafts=args.draft_policy != "always",
                              endpoint_metrics=True,
                              chain_drafts=args.draft_policy == "adaptive")
    if args.core_process:
        client = CoreClient(settings, loader=functools.partial(stand_in_runner, args))
        engine = Engine(settings, client.model, client, Tokenizer.from_gguf(client.model.file))
    else:
        runner, _, _ = stand_in_runner(args, settings)
        engine = Engine.local(settings, path, runner, None, Tokenizer.from_gguf(runner.gguf))  # type: ignore[arg-type]
    app = create_app(settings, engine=engine)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, loop="asyncio",
                    http="httptools")
    finally:
        engine.shutdown()  # (the app leaves an engine it was given running)


if __name__ == "__main__":
    main()
