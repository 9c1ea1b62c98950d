"""One model (plus optional draft model) ready to generate: what `generate` and `bench` use.

Generation goes through the same Scheduler as the server, turned from this thread (engine.generate).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from specserve.cli.args import (
    kv_types_from_args,
    remote_from_args,
    sampling_params_from_args,
    spec_params_from_args,
    tensor_parallel_from_args,
)
from specserve.engine.generate import run_task
from specserve.engine.loading import RemoteOptions, load_with_draft
from specserve.engine.runner import Runner, model_file
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Chunk, Result, Task
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels.kv_format import KVTypes
from specserve.model.lora import check_adapter_files
from specserve.speculative.base import Chain, SpecParams
from specserve.speculative.factory import build_chain


@dataclass
class GenerationSession:
    runner: Runner
    tokenizer: Tokenizer
    sampling: SamplingParams
    spec: SpecParams
    draft_runner: Runner | None = None
    adapters: tuple[float, ...] = ()  # a scale per LoRA adapter the runner loaded (Task.adapters)
    scheduler: Scheduler = field(init=False)

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.runner, self.tokenizer, chain_factory=self.new_chain)

    @classmethod
    def load(cls, model: str | None, *, sampling: SamplingParams | None = None, spec: SpecParams | None = None,
             draft_model: str | None = None, n_ctx: int | None = None, device: str | None = None,
             progress: bool = True, weight_format: str = "auto", kv_types: KVTypes = (None, None),
             draft_kv_types: KVTypes | None = None,
             remote: RemoteOptions | None = None, tensor_parallel: int = 1,
             lora: Sequence[tuple[str, float]] = ()) -> GenerationSession:
        """lora: (adapter file, scale) pairs, as --lora / --lora-scaled give them."""
        check_adapter_files(path for path, _ in lora)
        runner, draft_runner, _ = load_with_draft(model, draft_model, remote=remote, n_ctx=n_ctx, device=device,
                                                  progress=progress, weight_format=weight_format, kv_types=kv_types,
                                                  draft_kv_types=draft_kv_types,
                                                  tensor_parallel=tensor_parallel, adapters=[p for p, _ in lora])
        scales = tuple(scale for _, scale in lora)
        return cls(runner, Tokenizer.from_gguf(model_file(runner)), sampling or SamplingParams(),
                   (spec or SpecParams()).validate(), draft_runner, scales if any(scales) else ())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GenerationSession:
        return cls.load(args.model, sampling=sampling_params_from_args(args), spec=spec_params_from_args(args),
                        draft_model=args.model_draft, n_ctx=args.ctx_size, device=args.device,
                        weight_format=args.weight_format, kv_types=kv_types_from_args(args),
                        draft_kv_types=kv_types_from_args(args, draft=True),
                        remote=remote_from_args(args),
                        tensor_parallel=tensor_parallel_from_args(args), lora=getattr(args, "lora", ()))

    def prompt_tokens(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            text = apply_chat_template(self.tokenizer, [{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special=False, parse_special=True)
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    def new_chain(self, spec: SpecParams, slot: int = 0) -> Chain | None:
        return build_chain(spec, self.draft_runner, seq=slot)

    def run(self, prompt: str | list[int], *, chat: bool = False, n_predict: int = 128, out: TextIO | None = None,
            spec: SpecParams | None = None, sampling: SamplingParams | None = None) -> Result:
        """Generate, streaming text to `out` when given; the Result (timings, draft counts)."""
        tokens = prompt if isinstance(prompt, list) else self.prompt_tokens(prompt, chat)
        task = Task(prompt=tokens, sampling=sampling or self.sampling, spec=spec or self.spec, n_predict=n_predict,
                    adapters=self.adapters)
        for event in run_task(self.scheduler, task):
            if isinstance(event, Chunk):
                if out is not None and event.text:
                    out.write(event.text)
                    out.flush()
            else:
                if out is not None:
                    out.write("\n")
                    out.flush()
                return event
        raise AssertionError("run_task ends with a Result")

    def report_lines(self, result: Result) -> list[str]:
        """llama.cpp-style timing lines, then the speculators' statistics."""
        def line(label: str, ms: float, n: int) -> str:
            per = ms / n if n else 0.0
            rate = 1000.0 * n / ms if ms > 0 else 0.0
            return (f"{label} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, "
                    f"{rate:8.2f} tokens per second)")

        lines = [line("prompt eval time", result.prompt_ms, result.n_prompt - result.n_cached),
                 line("       eval time", result.predicted_ms, result.n_predicted)]
        chain = self.scheduler.slots[result.slot].chain
        if chain is not None and result.draft_n:
            lines += chain.stat_lines()
            lines.append(f"draft tokens = {result.draft_n}, accepted = {result.draft_n_accepted}")
        lines.append(f"stop type = {result.stop_type}, {result.n_steps} decode steps")
        return lines
