"""Side by side with llama.cpp on one MoE GGUF: Qwen3-30B-A3B's shapes, layers cut to 12, random weights.

    python benchmarks/moe_llama_cpp.py --llama-bin DIR [--types Q8_0,Q4_K_M] [--work DIR] [-o FILE]

Writes the model in F16 with gguf.GGUFWriter (architecture qwen3moe: hidden 2048, 128 experts, 8 used,
expert FFN 768, 32 query / 4 KV heads of 128, vocab 151936 of placeholder tokens), quantizes it to each
type with llama.cpp's llama-quantize, and times on the same file in one run: llama-bench (tg128 and
pp512, every layer on the GPU, 3 repetitions) and specserve's decode through the scheduler at 1 and 16
rows (moe_bench's decode table: CUDA graphs, tok/s and the fraction of the roofline of the bytes a step
reads). DIR holds llama.cpp's built binaries (llama-bench, llama-quantize). Prints the table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from bench_output import output_path, print_table, write_json
from gguf import GGUFWriter
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from llama_cpp_tools import llama_bench, llama_env
from moe_bench import decode_table, moe_config

from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import byte_alphabet


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's numpy shape (row-major, as GGUFWriter takes it), llama.cpp's qwen3moe names."""
    cfg = moe_config(layers, False)
    h, q, kv, e, f = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_expert, cfg.expert_ffn

    def name(t: MODEL_TENSOR, layer: int | None = None) -> str:
        return TENSOR_NAMES[t].format(bid=layer) + ".weight"

    shapes = {name(MODEL_TENSOR.TOKEN_EMBD): (cfg.vocab_size, h), name(MODEL_TENSOR.OUTPUT_NORM): (h,),
              name(MODEL_TENSOR.OUTPUT): (cfg.vocab_size, h)}
    for i in range(layers):
        shapes.update({name(MODEL_TENSOR.ATTN_NORM, i): (h,), name(MODEL_TENSOR.ATTN_Q, i): (q, h),
                       name(MODEL_TENSOR.ATTN_K, i): (kv, h), name(MODEL_TENSOR.ATTN_V, i): (kv, h),
                       name(MODEL_TENSOR.ATTN_OUT, i): (h, q), name(MODEL_TENSOR.ATTN_Q_NORM, i): (cfg.head_dim,),
                       name(MODEL_TENSOR.ATTN_K_NORM, i): (cfg.head_dim,), name(MODEL_TENSOR.FFN_NORM, i): (h,),
                       name(MODEL_TENSOR.FFN_GATE_INP, i): (e, h), name(MODEL_TENSOR.FFN_GATE_EXP, i): (e, f, h),
                       name(MODEL_TENSOR.FFN_UP_EXP, i): (e, f, h), name(MODEL_TENSOR.FFN_DOWN_EXP, i): (e, h, f)})
    return shapes


def write_f16(path: Path, layers: int, device: torch.device) -> None:
    """The model in F16 (norms in F32 near 1; matrices with unit-variance outputs), generated on `device`."""
    cfg = moe_config(layers, False)
    writer = GGUFWriter(str(path), "qwen3moe")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, cfg.context_length),
                       (writer.add_embedding_length, cfg.hidden), (writer.add_feed_forward_length, cfg.ffn),
                       (writer.add_head_count, cfg.n_heads), (writer.add_head_count_kv, cfg.n_kv_heads),
                       (writer.add_key_length, cfg.head_dim), (writer.add_value_length, cfg.head_dim),
                       (writer.add_rope_freq_base, cfg.rope_base), (writer.add_layer_norm_rms_eps, cfg.rms_eps),
                       (writer.add_expert_count, cfg.n_expert), (writer.add_expert_used_count, cfg.n_expert_used),
                       (writer.add_expert_feed_forward_length, cfg.expert_ffn)):
        add(value)
    chars = {b: c for c, b in byte_alphabet().items()}
    tokens = [chars[b] for b in range(256)] + ["ab", "<|endoftext|>"]
    tokens += [f"<|placeholder_{i}|>" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * (len(tokens) - 257))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(257)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in tensor_shapes(layers).items():
        w = torch.randn(shape, generator=gen, device=device)
        if len(shape) == 1:
            writer.add_tensor(name, (1.0 + 0.1 * w).float().cpu().numpy())
        else:
            writer.add_tensor(name, np.ascontiguousarray((w * shape[-1] ** -0.5).half().cpu().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", required=True, help="folder with llama.cpp's llama-bench and llama-quantize")
    ap.add_argument("--types", default="Q8_0,Q4_K_M", help="llama-quantize types to compare on")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--work", default="/tmp/moe_gguf", help="where the GGUF files go (~16 GB at F16)")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="specserve: tokens per sequence")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bin_dir, work = Path(args.llama_bin), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / f"qwen3moe-a3b-{args.layers}l-f16.gguf"
    t0 = time.perf_counter()
    if not f16.exists():
        write_f16(f16, args.layers, device)
    result: dict[str, object] = {"layers": args.layers, "f16_GB": round(f16.stat().st_size / 1e9, 2),
                                 "write_s": round(time.perf_counter() - t0, 1), "types": {}}
    table = []
    for qtype in args.types.split(","):
        path = work / f"qwen3moe-a3b-{args.layers}l-{qtype.lower()}.gguf"
        if not path.exists():
            subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(path), qtype, str(os.cpu_count() or 1)],
                           env=llama_env(bin_dir), check=True, capture_output=True, timeout=1200)
        try:
            rates = llama_bench(bin_dir / "llama-bench", path, gpu_layers=99)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        tg, pp = rates["tg"], rates["pp"]
        llama = {"tg128": None if tg is None else round(tg, 1), "pp512": None if pp is None else round(pp, 1)}
        runner = LocalRunner(path, n_seqs=16, n_ctx=args.n_predict + 64, device=device, weight_format="gguf",
                             progress=False)
        ours = decode_table(runner, [1, 16], args.n_predict)
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
        one = next(r for r in ours["rows"] if r["mode"] == ours["rows"][0]["mode"] and r["rows"] == 1)
        sixteen = next(r for r in ours["rows"] if r["mode"] == one["mode"] and r["rows"] == 16)
        table.append({"type": qtype, "GB": round(path.stat().st_size / 1e9, 2), "llama_tg128": llama.get("tg128"),
                      "llama_pp512": llama.get("pp512"), "specserve_1_row": one["tok_s"],
                      "vs_llama": round(one["tok_s"] / llama["tg128"], 2), "roofline_1": one["roofline_fraction"],
                      "specserve_16_rows": sixteen["tok_s"], "roofline_16": sixteen["roofline_fraction"]})
        result["types"][qtype] = {"llama_bench": llama, "specserve": ours}
    print_table(table, list(table[0]))
    result["table"] = table
    write_json(output_path(args.output, "moe_llama_cpp.json"), result)


if __name__ == "__main__":
    main()
