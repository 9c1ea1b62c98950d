"""What running the model on a remote host costs: greedy decode through the scheduler on a local runner and
on a RemoteRunner to a `specserve remote-host` process (unix socket, TCP), side by side in one run.

    python benchmarks/remote_bench.py -m smollm2-135m --device cpu -n 64
    python benchmarks/remote_bench.py -m qwen2.5-coder-1.5b --device cuda --weight-format gguf

Reports decode tok/s per transport, the ratio to local and the per-step overhead in microseconds
((remote - local) time / steps); prints a table and writes JSON (-o, default remote_<model>_<device>.json in
the cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_output import output_path, print_table, write_json

from specserve import catalog
from specserve.cli.measure import greedy_decode_rate
from specserve.cli.workloads import workload_prompts
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.remote.client import RemoteRunner


def start_host(address: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "remote-host", "--listen", address],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "listening" not in line:
        raise SystemExit(f"remote-host did not start: {line}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--device", default=None)
    ap.add_argument("--weight-format", default="auto")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help="code-edit prompts to decode after")
    ap.add_argument("--repeat", type=int, default=3, help="passes; the median is reported")
    ap.add_argument("--transports", default="unix,tcp", help="comma-separated: unix, tcp")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()

    path = catalog.resolve(args.model)
    local = LocalRunner(path, n_ctx=4096, device=args.device, weight_format=args.weight_format, progress=False)
    local.warmup(17)
    tok = Tokenizer.from_gguf(local.gguf)
    prompts = workload_prompts(tok, "code_edit")[: args.prompts]
    rows = []

    def measure(label: str, runner) -> None:  # noqa: ANN001 - a LocalRunner or a RemoteRunner
        rates = []
        totals = None
        for _ in range(args.repeat):
            rate, totals, _ = greedy_decode_rate(runner, tok, prompts, args.n_predict)
            rates.append(rate)
        rows.append({"runner": label, "tok_s": round(statistics.median(rates), 1), "steps": totals.steps})

    measure("local", local)
    sock = Path(tempfile.mkdtemp()) / "host.sock"
    addresses = {"unix": f"unix:{sock}", "tcp": "tcp:127.0.0.1:47615"}
    for label in args.transports.split(","):
        if label not in addresses:
            raise SystemExit(f"unknown transport '{label}' (unix, tcp)")
        address = addresses[label]
        host = start_host(address)
        try:
            remote = RemoteRunner(address, str(path), n_ctx=4096, device=args.device or "",
                                  weight_format=args.weight_format)
            remote.warmup(17)
            measure(label, remote)
            rows[-1]["round_trip_ms"] = round(remote.ping_ms(), 3)
            remote.close()
        finally:
            host.kill()
            host.wait(10)
    base = rows[0]["tok_s"]
    for row in rows:
        row["vs_local"] = round(row["tok_s"] / base, 3)
        per_step_local = 1e6 / base
        row["overhead_us_per_token"] = round(1e6 / row["tok_s"] - per_step_local, 1)
    print_table(rows, ["runner", "tok_s", "vs_local", "overhead_us_per_token", "round_trip_ms", "steps"])
    device = str(local.device.type)
    write_json(output_path(args.output, f"remote_{args.model}_{device}.json"),
               {"model": args.model, "device": device, "weight_format": local.weight_format,
                "n_predict": args.n_predict, "rows": rows})


if __name__ == "__main__":
    main()
