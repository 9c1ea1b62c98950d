"""Constrained-output libraries on specserve's own vocabulary (the model's GGUF tokenizer), on the CPU.

    python benchmarks/constraint_bench.py [-m smollm2-135m] [-o FILE] [--threads 1]

For each library that is installed (llguidance, which specserve uses; xgrammar and outlines-core if present):
import time, building its vocabulary, compiling a GBNF alternative, a GBNF list grammar, a JSON schema with
required fields and "any JSON object", the mask of each position while a 58-token JSON document is walked
(median and total), and the masks of a verify step (an 8-token draft: 9 rows, walked and rolled back).
outlines-core has no context-free grammars (regex and JSON schema only) and no batched draft walk here.
Then specserve's own path (llguidance): `Constraint.apply` on 1 and 9 logit rows (masks, unpacking, -inf
fill) next to one decode step of the model, the cost it adds to. Writes JSON (-o, default
constraint_bench.json in the cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_output import output_path, print_table, write_json

from specserve import catalog
from specserve.engine.constraints import JSON_WHITESPACE, GrammarCompiler, GrammarSource, _Vocabulary
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch

GBNF = {"gbnf yes/no": 'root ::= "yes" | "no"',
        "gbnf list": 'root ::= item ("," " "? item)*\nitem ::= [a-z]+ | [0-9]+ ("." [0-9]+)?'}
SCHEMA = {"type": "object", "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}}


def best_ms(fn: Callable[[], Any], reps: int = 3) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


def walk(doc: list[int], step: Callable[[int], None]) -> dict[str, float]:
    """step(token): compute the mask, consume the token; its median and total time over the document."""
    times = []
    for token in doc:
        t = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - t)
    return {"mask_us_p50": round(statistics.median(times) * 1e6, 1), "walk_ms": round(sum(times) * 1e3, 2)}


def verify_us(doc: list[int], mask: Callable[[int], object], consume: Callable[[int], object],
              rollback: Callable[[int], object]) -> int:
    """A verify step of 8 draft tokens (doc[10:18], the matcher standing after doc[:10]): a mask before each
    token and after the last, then the rollback that a rejected draft needs; best of 20, in us."""

    def verify() -> None:
        for j, d in enumerate(doc[10:18]):
            mask(j)
            consume(d)
        mask(8)
        rollback(8)

    return round(best_ms(verify, 20)[0] * 1e3)


def bench_llguidance(tok: Tokenizer, doc: list[int]) -> dict[str, Any]:
    t = time.perf_counter()
    llg = importlib.import_module("llguidance")
    row: dict[str, Any] = {"library": "llguidance", "import_ms": round((time.perf_counter() - t) * 1e3)}
    vocab = _Vocabulary(tok)
    ms, lt = best_ms(lambda: llg.LLTokenizer(llg.TokenizerWrapper(vocab), eos_token=sorted(tok.eog_ids)), 1)
    row["vocab_ms"] = round(ms, 1)
    opts = {"whitespace_pattern": JSON_WHITESPACE}
    grammars = {**{k: llg.grammar_from("gbnf", g) for k, g in GBNF.items()},
                "schema": llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=opts),
                "json_object": llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=opts)}
    for name, g in grammars.items():
        row[f"{name} ms"] = round(best_ms(lambda g=g: llg.LLMatcher(lt, g))[0], 2)
    words = (tok.vocab_size + 31) // 32
    mask = torch.empty((9, words), dtype=torch.int32)
    m = llg.LLMatcher(lt, grammars["schema"])
    row.update(walk(doc, lambda i: (m.unsafe_compute_mask_ptr(mask[0].data_ptr(), words * 4), m.consume_token(i))))
    m.reset()
    m.consume_tokens(doc[:10])
    row["verify_8_us"] = verify_us(doc, lambda j: m.unsafe_compute_mask_ptr(mask[j].data_ptr(), words * 4),
                                   m.consume_token, m.rollback)
    return row


def bench_xgrammar(tok: Tokenizer, doc: list[int]) -> dict[str, Any]:
    t = time.perf_counter()
    xgr = importlib.import_module("xgrammar")
    row: dict[str, Any] = {"library": "xgrammar", "import_ms": round((time.perf_counter() - t) * 1e3)}
    # Special tokens as empty strings: xgrammar then never lets grammar text match them.
    vocab = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]
    ms, info = best_ms(lambda: xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=sorted(tok.eog_ids)), 1)
    row["vocab_ms"] = round(ms, 1)

    def compiled(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        return lambda: fn(xgr.GrammarCompiler(info, cache_enabled=False))

    for name, g in GBNF.items():
        row[f"{name} ms"] = round(best_ms(compiled(lambda c, g=g: c.compile_grammar(g)))[0], 2)
    ms, schema = best_ms(compiled(lambda c: c.compile_json_schema(json.dumps(SCHEMA))))
    row["schema ms"] = round(ms, 2)
    row["json_object ms"] = round(best_ms(compiled(lambda c: c.compile_builtin_json_grammar()))[0], 2)
    mask = xgr.allocate_token_bitmask(9, tok.vocab_size)
    m = xgr.GrammarMatcher(schema)
    row.update(walk(doc, lambda i: (m.fill_next_token_bitmask(mask, 0), m.accept_token(i))))
    m = xgr.GrammarMatcher(schema)
    for i in doc[:10]:
        m.accept_token(i)
    row["verify_8_us"] = verify_us(doc, lambda j: m.fill_next_token_bitmask(mask, j), m.accept_token, m.rollback)
    return row


def bench_outlines(tok: Tokenizer, doc: list[int]) -> dict[str, Any]:
    t = time.perf_counter()
    oc = importlib.import_module("outlines_core")
    from outlines_core.json_schema import build_regex_from_schema
    row: dict[str, Any] = {"library": "outlines-core", "import_ms": round((time.perf_counter() - t) * 1e3)}
    entries: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if not tok.is_special(i) and tok.token_bytes(i):
            entries.setdefault(tok.token_bytes(i), []).append(i)
    eos = tok.eos_id if tok.eos_id is not None else 0
    ms, voc = best_ms(lambda: oc.Vocabulary(eos, entries), 1)
    row["vocab_ms"] = round(ms, 1)
    ms, index = best_ms(lambda: oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), voc), 1)
    row["schema ms"] = round(ms, 2)
    guide = oc.Guide(index)
    row.update(walk(doc, lambda i: (guide.get_tokens(), guide.advance(i))))
    return row


def specserve_path(model: str, tok: Tokenizer, doc: list[int]) -> dict[str, Any]:
    """Constraint.apply (what a constrained slot adds per step) against one decode step of the model."""
    compiler = GrammarCompiler(tok)
    compiler.warm()
    constraint = compiler.compile(GrammarSource.json_schema(SCHEMA))
    constraint.advance(doc[:10])
    vocab = tok.vocab_size
    rows1, rows9 = torch.randn(1, vocab), torch.randn(9, vocab)
    one = best_ms(lambda: constraint.apply(rows1, []), 20)[0]
    nine = best_ms(lambda: constraint.apply(rows9, doc[10:18]), 20)[0]
    runner = LocalRunner(catalog.pull(model), n_seqs=1, n_ctx=256, device="cpu", progress=False)
    prefix = Batch()
    prefix.add_sequence(doc[:8], 0, 0)
    runner.forward(prefix)
    one_token = Batch()
    one_token.add_sequence(doc[8:9], 8, 0)

    def step() -> None:
        runner.kv_truncate(0, 8)
        runner.forward(one_token)

    return {"apply_1_row_ms": round(one, 3), "apply_9_rows_ms": round(nine, 3),
            "decode_step_ms": round(best_ms(step, 5)[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("-o", "--output")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the mask work is one thread)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_gguf(GGUFFile(catalog.pull(args.model)))
    doc = tok.encode(json.dumps(DOC), add_special=False)
    rows = []
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                     ("outlines_core", bench_outlines)):
        try:
            rows.append(fn(tok, doc))
        except ImportError:
            print(f"({name} is not installed: skipped)")
    columns = ["library", "import_ms", "vocab_ms", *[f"{k} ms" for k in GBNF], "schema ms", "json_object ms",
               "mask_us_p50", "walk_ms", "verify_8_us"]
    print_table(rows, columns)
    own = specserve_path(args.model, tok, doc)
    print(f"\nspecserve (llguidance): Constraint.apply {own['apply_1_row_ms']} ms for 1 row, "
          f"{own['apply_9_rows_ms']} ms for 9; one decode step of {args.model}: {own['decode_step_ms']} ms")
    write_json(output_path(args.output, "constraint_bench.json"),
               {"model": args.model, "doc_tokens": len(doc), "libraries": rows, "specserve": own})


if __name__ == "__main__":
    main()
