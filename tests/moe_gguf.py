"""Tiny random HF transformers MoE models and their GGUF files in llama.cpp's layout.

`hf_model` builds a Qwen2-MoE, Qwen3-MoE or Mixtral model with random weights at unit scale (HF's own
initialisation is so small that every logit is near zero and greedy choices become near ties);
`write_gguf` writes its weights as llama.cpp's converter lays them out: the tensor names of the gguf
package's tables, experts stacked [n_expert, ...], Q and K of llama files permuted for interleaved RoPE,
the metadata keys, and a byte-level BPE vocabulary (256 byte tokens, one merge, a few control tokens).
`quantize_gguf` copies such a file with its matrices and expert tensors in block formats.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from gguf.quants import quantize

from specserve.gguf.tokenizer import byte_alphabet

HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM, N_LAYERS = 64, 4, 2, 16, 2
N_EXPERT, N_EXPERT_USED, EXPERT_FFN, SHARED_FFN, DENSE_FFN = 8, 2, 32, 64, 96
MERGED = ["ab"]  # one merge: a GGUF vocabulary needs a non-empty merge list
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB = 256 + len(MERGED) + len(CONTROL_TOKENS)
EOS = 256 + len(MERGED)
ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def hf_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer MoE model of `model_type` (8 experts, 2 used) in fp32 with random unit-scale weights."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                  num_key_value_heads=N_KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    moe = dict(num_experts=N_EXPERT, num_experts_per_tok=N_EXPERT_USED, moe_intermediate_size=EXPERT_FFN,
               intermediate_size=DENSE_FFN)
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(**common, **moe, head_dim=HEAD_DIM, norm_topk_prob=True)
    elif model_type == "qwen2_moe":
        config = Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=SHARED_FFN, norm_topk_prob=False)
    else:
        config = MixtralConfig(**common, intermediate_size=EXPERT_FFN, num_local_experts=N_EXPERT,
                               num_experts_per_tok=N_EXPERT_USED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias") or name.endswith("shared_expert_gate.weight"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return model.float().eval()


def _name(tensor: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    return TENSOR_NAMES[tensor].format(bid=layer) + "." + suffix


def _interleave_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation: each head's two halves (HF's rotate_half pairs) become adjacent pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {_name(MODEL_TENSOR.TOKEN_EMBD): sd["model.embed_tokens.weight"],
           _name(MODEL_TENSOR.OUTPUT_NORM): sd["model.norm.weight"], _name(MODEL_TENSOR.OUTPUT): sd["lm_head.weight"]}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        attn = {MODEL_TENSOR.ATTN_NORM: "input_layernorm.weight", MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj.weight",
                MODEL_TENSOR.FFN_NORM: "post_attention_layernorm.weight", MODEL_TENSOR.FFN_GATE_INP: "mlp.gate.weight",
                MODEL_TENSOR.FFN_DOWN_EXP: "mlp.experts.down_proj"}
        out.update({_name(t, i): sd[p + hf] for t, hf in attn.items()})
        for t, proj, heads in ((MODEL_TENSOR.ATTN_Q, "q", N_HEADS), (MODEL_TENSOR.ATTN_K, "k", N_KV_HEADS),
                               (MODEL_TENSOR.ATTN_V, "v", 0)):
            w = sd[p + f"self_attn.{proj}_proj.weight"]
            out[_name(t, i)] = _interleave_rope(w, heads) if arch == "llama" and heads else w
            if p + f"self_attn.{proj}_proj.bias" in sd:
                out[_name(t, i, "bias")] = sd[p + f"self_attn.{proj}_proj.bias"]
        if p + "self_attn.q_norm.weight" in sd:
            out[_name(MODEL_TENSOR.ATTN_Q_NORM, i)] = sd[p + "self_attn.q_norm.weight"]
            out[_name(MODEL_TENSOR.ATTN_K_NORM, i)] = sd[p + "self_attn.k_norm.weight"]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [n_expert, gate | up, hidden]
        out[_name(MODEL_TENSOR.FFN_GATE_EXP, i)] = gate_up[:, :EXPERT_FFN]
        out[_name(MODEL_TENSOR.FFN_UP_EXP, i)] = gate_up[:, EXPERT_FFN:]
        if p + "mlp.shared_expert_gate.weight" in sd:
            out[_name(MODEL_TENSOR.FFN_GATE_INP_SHEXP, i)] = sd[p + "mlp.shared_expert_gate.weight"].reshape(-1)
            for t, proj in ((MODEL_TENSOR.FFN_GATE_SHEXP, "gate"), (MODEL_TENSOR.FFN_UP_SHEXP, "up"),
                            (MODEL_TENSOR.FFN_DOWN_SHEXP, "down")):
                out[_name(t, i)] = sd[p + f"mlp.shared_expert.{proj}_proj.weight"]
    return out


def write_gguf(model: torch.nn.Module, path: Path) -> Path:
    """The model's weights (fp32) and config as a GGUF file of its llama.cpp architecture."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(N_EXPERT)
    writer.add_expert_used_count(N_EXPERT_USED)
    if arch != "llama":  # Mixtral files give the expert size as feed_forward_length
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(SHARED_FFN)
    chars = {b: c for c, b in byte_alphabet().items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([chars[b] for b in range(256)] + MERGED + CONTROL_TOKENS)
    writer.add_token_types([1] * (256 + len(MERGED)) + [3] * len(CONTROL_TOKENS))
    writer.add_token_merges([" ".join(token) for token in MERGED])
    writer.add_eos_token_id(EOS)
    for name, array in _tensors(model, arch).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_gguf(src: Path, dst: Path,
                  qtype: Callable[[str], GGMLQuantizationType] = lambda name: GGMLQuantizationType.Q8_0) -> Path:
    """A copy of src with every matrix and expert tensor in qtype(name) (Q8_0 by default; the gguf
    package quantizes Q8_0, Q4_0/1 and Q5_0/1); norms and the router stay F32."""
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.types[0].name == "ARRAY":
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, field.types[0])
    for t in reader.tensors:
        array = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        if array.ndim >= 2 and "ffn_gate_inp" not in t.name:
            kind = qtype(t.name)
            writer.add_tensor(t.name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
