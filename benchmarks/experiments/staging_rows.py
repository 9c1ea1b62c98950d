"""Experiment: staging rows per pass (MU) and TILES=3 for gate_up; fused products + model GPU time."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import torch
from specserve.kernels import linear_cuda as lc
mu = os.environ.get("MU_VARIANT", "default")
src, names = lc.KERNELS["gemv_mma"]
old = "#define MU (SILU || M > 8 ? (M < 4 ? M : 4) : (M < 8 ? M : 8))"
if mu == "4":
    src = src.replace(old, "#define MU (M < 4 ? M : 4)")
elif mu == "2":
    src = src.replace(old, "#define MU (M < 2 ? M : 2)")
lc.KERNELS["gemv_mma"] = (src, names)
import kernel_bench as kb
out = {"mu": mu, "fused": [], "model": None}
for name in ("gate_up", "down_q4k", "wqkv", "wo", "output"):
    n, k, _silu, bits, group = kb.MATRICES[name]
    qs = kb.Rotation(kb.quant_copies(n, k, bits, group))
    for m in (1, 2, 8, 9):
        call = kb.fused_call(name, m, qs, k)
        r = {"matrix": name, "rows": m, "default": kb.timed(call, 2 * len(qs.items), qs.items[0].n_bytes()).get("us")}
        if name in ("gate_up",):
            for t in (3, 4):
                b = {"TILES": t, "KSPLIT": 2, "D": 2}
                r[f"t{t}"] = kb.timed(lambda c=call, b=b: c(b), 2 * len(qs.items), qs.items[0].n_bytes()).get("us")
        out["fused"].append(r)
        print(json.dumps(r), flush=True)
    del qs
    torch.cuda.empty_cache()
os.environ["SPECSERVE_QUANT_KERNEL"] = "mma"
runner = kb.make_runner("gguf_like")
runner.warmup(17, prompt_rows=0)
from specserve.engine.batch import Batch
runner.kv_truncate(0, 0)
b = Batch(); b.add_sequence(list(range(600)), 0, 0, "last"); runner.forward(b)
gpu = {r: round(kb.replay_us(kb.graph_at(runner, r)), 1) for r in (1, 2, 4, 8, 9, 16)}
out["model"] = gpu
print(mu, "model", gpu, "ratio8", round(gpu[8] / gpu[1], 3), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"exp_mu_{mu}.json"), "w"), indent=1)
