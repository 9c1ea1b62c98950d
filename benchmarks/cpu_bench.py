"""CPU speed side by side with llama.cpp on the same GGUF file, in one run: prompt processing (ppN) and
decode (tgN) tokens/s for specserve (each weight format) and for llama.cpp's own llama-bench.

    python benchmarks/cpu_bench.py -m smollm2-135m --threads 2

llama.cpp is never a dependency of specserve. The reference is llama-bench built from the source vendored in the
llama-cpp-python sdist (default path below, or --llama-bench):
    pip download --no-deps --no-binary :all: -d /tmp llama-cpp-python==0.3.36
    mkdir -p ~/.cache/specserve && tar xzf /tmp/llama_cpp_python-0.3.36.tar.gz -C ~/.cache/specserve
    cd ~/.cache/specserve/llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        && cmake --build build -j --target llama-bench
On a CPU that reports AMX inside a VM a native build can crash in its first batch (AMX tiles the guest may not
use): build with -DGGML_NATIVE=OFF and the ISA listed instead (-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_INT8=OFF
-DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF). Without llama-bench, llama-cpp-python in ~/.cache/specserve/llamacpp-venv
is timed instead, flagged in the table: its per-token eval() understates llama.cpp's decode several times
(smollm2 on the 2-core Xeon: 28 tok/s against llama-bench's 130).
A format "<fmt>-exact" times <fmt> with SPECSERVE_CPU_EXACT=1 (the exact fp32 kernel instead of the int8 one).
Both sides evaluate tokens without sampling for pp and tg, as llama-bench does; specserve's
tg also goes through its scheduler (`bench_decode`, host work included). --rounds R interleaves R rounds of both
sides (a busy spell of a shared machine then falls on both) and reports medians. Prints a table, writes JSON (-o,
default cpu_<model>.json in the cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch
from bench_output import output_path, print_table, write_json
from llama_cpp_tools import llama_bench

from specserve import catalog, foreign_env
from specserve.cli.measure import bench_decode, bench_prefill
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings

LLAMA_VENV = catalog.cache_dir() / "llamacpp-venv" / "bin" / "python"

LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, pp, tg, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=path, n_ctx=pp + tg + 16, n_threads=threads, n_threads_batch=threads, n_batch=pp,
            verbose=False, logits_all=False)
tokens = [(i * 7919) % llm.n_vocab() for i in range(pp)]
best_pp = best_tg = 0.0
for _ in range(reps):
    llm.reset()
    t0 = time.perf_counter(); llm.eval(tokens); best_pp = max(best_pp, pp / (time.perf_counter() - t0))
    llm.reset(); llm.eval(tokens[:16])
    t0 = time.perf_counter()
    for i in range(tg):
        llm.eval([tokens[16 + i % 64]])
    best_tg = max(best_tg, tg / (time.perf_counter() - t0))
print(json.dumps({"pp": best_pp, "tg": best_tg}))
"""


LLAMA_BENCH = (catalog.cache_dir() / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
               / "llama-bench")


def llama_cpp(path: Path, threads: int, pp: int, tg: int, reps: int) -> dict[str, float] | None:
    if not LLAMA_VENV.exists():
        print(f"llama.cpp skipped: no llama-bench and no {LLAMA_VENV} (see this script's docstring)")
        return None
    out = subprocess.run([str(LLAMA_VENV), "-c", LLAMA_SCRIPT, str(path), str(threads), str(pp), str(tg), str(reps)],
                         capture_output=True, text=True, timeout=1800, env=foreign_env())
    if out.returncode != 0:
        print(f"llama.cpp failed: {out.stderr[-2000:]}")
        return None
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "via": "llama-cpp-python"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="best of (llama-bench: the mean of)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds of specserve and llama.cpp; medians, and the median per-round ratio")
    ap.add_argument("--formats", default="auto,float", help="specserve weight formats to time")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH, help="llama.cpp's llama-bench binary")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = catalog.resolve(args.model)
    runners = {}
    for name in args.formats.split(","):
        runners[name] = LocalRunner(path, device="cpu", n_ctx=args.n_prompt + args.n_gen + 64,
                                    weight_format=name.removesuffix("-exact"), progress=False)
    tok = Tokenizer.from_gguf(next(iter(runners.values())).gguf)
    rates: dict[str, list[tuple[float | None, float | None]]] = {name: [] for name in [*runners, "llama.cpp"]}
    via = None
    for _ in range(args.rounds):  # interleaved: a busy spell of the machine falls on both sides
        for name, runner in runners.items():
            os.environ["SPECSERVE_CPU_EXACT"] = "1" if name.endswith("-exact") else "0"  # read per product
            kernel_settings.reload()
            pp = bench_prefill(runner, args.n_prompt, reps=args.reps)
            rates[name].append((pp, max(bench_decode(runner, tok, args.n_gen) for _ in range(args.reps))))
        os.environ.pop("SPECSERVE_CPU_EXACT", None)
        kernel_settings.reload()
        if args.llama_bench.exists():
            try:
                ref = {**llama_bench(args.llama_bench, path, n_prompt=args.n_prompt, n_gen=args.n_gen,
                                     reps=args.reps, threads=args.threads), "via": "llama-bench"}
            except RuntimeError as exc:
                print(exc)
                ref = {"pp": None, "tg": None, "via": "llama-bench"}  # (the round stays paired with ours)
        else:
            ref = llama_cpp(path, args.threads, args.n_prompt, args.n_gen, args.reps)
        if ref is not None:  # (None in every round: no llama.cpp here)
            via = ref["via"]
            rates["llama.cpp"].append((ref["pp"], ref["tg"]))
    rows = []
    for name, got in rates.items():
        if not got:
            continue
        label = name if name == "llama.cpp" else f"specserve {runners[name].weight_format}" + (
            "-exact" if name.endswith("-exact") else "")
        if name == "llama.cpp" and via != "llama-bench":
            label += " (python eval)"
        row: dict[str, object] = {"engine": label, f"pp{args.n_prompt}": _median([r[0] for r in got], 1),
                                  f"tg{args.n_gen}": _median([r[1] for r in got], 1)}
        if name != "llama.cpp" and rates["llama.cpp"]:  # the median of the rounds' ratios (where llama.cpp gave one)
            pairs = list(zip(got, rates["llama.cpp"], strict=True))
            row["pp_vs_llamacpp"] = _median([a[0] / b[0] if b[0] else None for a, b in pairs], 2)
            row["tg_vs_llamacpp"] = _median([a[1] / b[1] if b[1] else None for a, b in pairs], 2)
            row["tg_ratio_by_round"] = [round(a[1] / b[1], 2) if b[1] else None for a, b in pairs]
        rows.append(row)
    print_table(rows, ["engine", f"pp{args.n_prompt}", f"tg{args.n_gen}", "pp_vs_llamacpp", "tg_vs_llamacpp"])
    if args.rounds > 1:
        for row in rows:
            if "tg_ratio_by_round" in row:
                print(f"{row['engine']}: tg vs llama.cpp by round {row['tg_ratio_by_round']}")
    write_json(output_path(args.output, f"cpu_{args.model}.json"),
               {"model": args.model, "threads": args.threads, "rounds": args.rounds, "rows": rows})


def _median(values: list[float | None], digits: int) -> float | None:
    """The median of the values that are there (None: a run that failed), rounded; None if none is."""
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), digits) if kept else None


if __name__ == "__main__":
    main()
