"""One model (plus optional draft model) ready to generate: what `generate` and `bench` use.

Sits above engine and speculative: it wires runner, tokenizer, sampler and speculator.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TextIO

from specserve import catalog
from specserve.engine.generate import GenerationStats, generate
from specserve.engine.runner import LocalRunner
from specserve.engine.sampling import Sampler, SamplingParams
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.tokenizer import IncrementalDecoder, Tokenizer
from specserve.speculative.base import Chain, SpecParams
from specserve.speculative.draft_model import load_with_draft
from specserve.speculative.factory import build_chain


@dataclass
class GenerationSession:
    runner: LocalRunner
    tokenizer: Tokenizer
    sampling: SamplingParams
    spec: SpecParams
    draft_runner: LocalRunner | None = None

    @classmethod
    def load(cls, model: str | None, *, sampling: SamplingParams | None = None, spec: SpecParams | None = None,
             draft_model: str | None = None, n_ctx: int | None = None, device: str | None = None,
             progress: bool = True, weight_format: str = "auto") -> GenerationSession:
        runner, draft_runner = load_with_draft(
            catalog.resolve(model), catalog.resolve(draft_model) if draft_model is not None else None,
            n_ctx=n_ctx, device=device, progress=progress, weight_format=weight_format)
        return cls(runner, Tokenizer.from_gguf(runner.gguf), sampling or SamplingParams(),
                   (spec or SpecParams()).validate(), draft_runner)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GenerationSession:
        from specserve.cli import sampling_params_from_args, spec_params_from_args

        return cls.load(args.model, sampling=sampling_params_from_args(args), spec=spec_params_from_args(args),
                        draft_model=args.model_draft, n_ctx=args.ctx_size, device=args.device,
                        weight_format=args.weight_format)

    def prompt_tokens(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            text = apply_chat_template(self.tokenizer, [{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special=False, parse_special=True)
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    def new_chain(self, spec: SpecParams | None = None) -> Chain | None:
        return build_chain(spec or self.spec, self.draft_runner)

    def run(
        self, prompt: str, *, chat: bool = False, n_predict: int = 128, out: TextIO | None = None,
        spec: SpecParams | None = None, sampling: SamplingParams | None = None,
    ) -> tuple[GenerationStats, Chain | None]:
        """Generate, streaming text to `out` when given; returns stats and the chain used."""
        spec = spec or self.spec
        tokens = self.prompt_tokens(prompt, chat)
        chain = self.new_chain(spec)
        stats = GenerationStats()
        decoder = IncrementalDecoder(self.tokenizer)
        for token in generate(self.runner, tokens, n_predict, Sampler(sampling or self.sampling),
                              is_eog=self.tokenizer.is_eog, speculator=chain, n_draft_max=spec.n_max,
                              n_draft_min=spec.n_min, stats=stats):
            if out is not None and not self.tokenizer.is_eog(token):
                out.write(decoder.add(token))
                out.flush()
        if out is not None:
            out.write(decoder.flush() + "\n")
            out.flush()
        return stats, chain

    def report_lines(self, result: tuple[GenerationStats, Chain | None]) -> list[str]:
        stats, chain = result
        lines = list(stats.timing_lines())
        if chain is not None:
            lines += chain.stat_lines()
            lines.append(f"target forward passes = {stats.target_forwards} for {stats.generated} tokens")
        return lines
