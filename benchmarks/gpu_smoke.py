"""The first run on a GPU machine: catches broken GPU paths before anything else is measured.

    python benchmarks/gpu_smoke.py -m qwen2.5-coder-1.5b --weight-format gguf -o smoke.json

In one table: the GPU test files (kernels, graphs, CUDA builds, the KV pool, batch invariance, sampling),
one client through `specserve serve` with a small pool (-np 1 -c 2048) and with a pool sized for many clients
(-np 64 -c 1048576), their ratio (a step's cost must follow the tokens in use, not the pool), 64 clients on the
large pool, and greedy fidelity through the server with and without --batch-invariant. Each part runs as its
own process with a time limit, so one that hangs or crashes is a failed row, not a lost run. Writes JSON
(bench_output.py; the parts' own JSON beside it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench_output import output_path, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/test_kernels.py", "tests/test_graph_buckets.py", "tests/test_cuda_builds.py",
             "tests/test_kv_blocks.py", "tests/test_kv_pool.py", "tests/test_batch_invariant.py",
             "tests/test_sampling.py", "tests/test_lora.py", "tests/test_host_cache.py",
             "tests/test_kv_types.py", "tests/test_token_tree_cuda.py"]
BIG_SLOTS, BIG_CTX = 64, 1 << 20
MIN_RATIO = 0.95  # one client on the large pool against the small one


def run(name: str, cmd: list[str], timeout: float, log_dir: Path) -> tuple[int, float, str]:
    """(exit code, seconds, output) of a part; 124 when it ran past its limit. The output also goes to a log."""
    print(f"--- {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {timeout:.0f} s)"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    (log_dir / f"smoke_{name}.log").write_text(out)
    return rc, time.monotonic() - t0, out


def tests_row(args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    # Four workers where pytest-xdist is installed (the GPU image has it): Triton compiles each kernel variant
    # on first use, and that is most of the files' time on a fresh machine.
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    rc, secs, out = run("tests", [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *workers,
                                  *GPU_TESTS], args.test_timeout, log_dir)
    # pytest -q ends with "N passed, M failed in S s", with or without "=" around it
    summary = next((line for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed|error)", line) and " in " in line), "no summary")
    failed = [line.split(" ")[1] for line in out.splitlines() if line.startswith("FAILED ")]
    return {"part": "GPU tests", "result": summary.strip("= "), "ok": rc == 0, "seconds": round(secs),
            "failed": failed}


def serve(args: argparse.Namespace, name: str, clients: str, slot_ctx: int, log_dir: Path,
          extra: list[str] | None = None) -> tuple[dict[str, object], list[dict]]:
    out = log_dir / f"smoke_serve_{name}.json"
    cmd = [sys.executable, "benchmarks/serve_bench.py", "-m", args.model, "--device", args.device, "--clients", clients,
           "--slot-ctx", str(slot_ctx), "--requests", "2", "-n", "128", "--modes", "none", "--prompts",
           str(args.prompts), "-o", str(out), "--server-args", "--weight-format", args.weight_format, *(extra or [])]
    rc, secs, _ = run(f"serve_{name}", cmd, args.serve_timeout, log_dir)
    results = json.loads(out.read_text())["results"] if rc == 0 and out.exists() else []
    return {"rc": rc, "seconds": round(secs)}, results


def fidelity_row(args: argparse.Namespace, invariant: bool, log_dir: Path) -> dict[str, object]:
    name = "fidelity_invariant" if invariant else "fidelity"
    out = log_dir / f"smoke_{name}.json"
    cmd = [sys.executable, "benchmarks/fidelity_check.py", "-m", args.model, "--device", args.device, "-n", "64",
           "--types", "ngram-suffix", "--prompts", str(args.prompts), "-o", str(out),
           "--server-args", "--weight-format", args.weight_format, *(["--batch-invariant"] if invariant else [])]
    rc, secs, text = run(name, cmd, args.serve_timeout, log_dir)
    if not out.exists():
        tail = text.strip().splitlines()[-1:] or ["no output"]
        return {"part": name, "result": f"failed (rc {rc}): {tail[0][:80]}", "ok": False, "seconds": round(secs)}
    data = json.loads(out.read_text())
    result = ", ".join(f"{k} {v}/{data['of']}" for k, v in data["equal"].items())
    # Without batch invariance a row's bits may follow its batch (cuBLAS picks kernels by row count): reported,
    # not required. With it, every text must equal the one written alone.
    ok = rc == 0 or not invariant
    return {"part": name, "result": result, "ok": ok, "seconds": round(secs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weight-format", default="gguf")
    p.add_argument("--device", default="cuda", help="(another device only to try the script itself)")
    p.add_argument("--prompts", type=Path, default=ROOT.parent / "shared" / "workloads" / "prompts.json")
    p.add_argument("--parts", default="tests,serve,fidelity", help="which parts to run")
    p.add_argument("--test-timeout", type=float, default=300)
    p.add_argument("--serve-timeout", type=float, default=240)
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    out = output_path(args.output, f"gpu_smoke_{args.weight_format}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    rows: list[dict[str, object]] = []
    if "tests" in parts:
        rows.append(tests_row(args, out.parent))
    if "serve" in parts:
        small_run, small = serve(args, "small", "1", 2048, out.parent)
        big_run, big = serve(args, "large", f"1,{BIG_SLOTS}", BIG_CTX // BIG_SLOTS, out.parent)
        one_small = round(small[0]["tokens_per_s"], 1) if small else None
        one_big = round(big[0]["tokens_per_s"], 1) if big else None
        rows.append({"part": "1 client, -np 1 -c 2048", "result": f"{one_small} tok/s" if one_small else "failed",
                     "ok": one_small is not None, **small_run})
        ratio = round(one_big / one_small, 3) if one_small and one_big else None
        rows.append({"part": f"1 client, -np {BIG_SLOTS} -c {BIG_CTX}", "ok": ratio is not None and ratio >= MIN_RATIO,
                     "result": f"{one_big} tok/s, x{ratio} of the small pool" if ratio else "failed", **big_run})
        many = big[1] if len(big) > 1 else None
        rows.append({"part": f"{BIG_SLOTS} clients, -np {BIG_SLOTS} -c {BIG_CTX}", "ok": many is not None,
                     "result": f"{many['tokens_per_s']:.0f} tok/s, ITL p99 {many['itl_p99_ms']:.1f} ms" if many
                     else "failed"})
    if "fidelity" in parts:
        rows += [fidelity_row(args, False, out.parent), fidelity_row(args, True, out.parent)]
    for row in rows:
        row["ok"] = "yes" if row["ok"] else "NO"
    print_table(rows, ["part", "ok", "result", "seconds"])
    write_json(out, {"model": args.model, "weight_format": args.weight_format, "rows": rows})
    return 0 if all(r["ok"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
