"""A CPU step's dense decoder layers in one C call (cpu/layers.c) instead of ~9 ctypes calls a layer: the same
kernels in the same order, so the stream and the KV cache come out as the op-by-op path leaves them, bit for bit.
On a 135M model each op's Python and ctypes round trip (~10 us) was as long as its arithmetic.

`whole_layers` gives the call for a CPU runner's kernels and a model whose every layer is NormQKVRope ->
LinearAdd -> NormFeedForwardAdd on packed weights the int8 kernel takes, without head norms or adapters. A step
qualifies when its stream has nothing pending, no adapter scales and fp32 rows, and the caches hold rows the C
code reads (cpu_ops.paged). Anything else (MoE layers, float weights, SPECSERVE_CPU_EXACT=1,
SPECSERVE_CPU_LAYERS=0) runs op by op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from specserve.kernels import cpu_ops, quant_cpu
from specserve.kernels.cpu import build
from specserve.kernels.cpu_kernels import CpuKernels
from specserve.kernels.quant_weight import QuantWeight
from specserve.kernels.settings import settings
from specserve.kernels.step_ops import LinearAdd, NormFeedForwardAdd, NormQKVRope, ResidualStream, StepOp
from specserve.kernels.torch_kernels import TorchKernels

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Matrix(ctypes.Structure):
    _fields_ = [("words", _ptr), ("sm", _ptr), ("perm", _ptr),
                *((name, _i32) for name in ("n", "k", "words_per_row", "groups_per_row", "bits", "words_per_group",
                                            "chunks"))]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("ffn_norm", _ptr), ("qkv_bias", _ptr), ("qkv", _Matrix), ("o", _Matrix),
                ("gate_up", _Matrix), ("down", _Matrix), ("k_data", _ptr), ("v_data", _ptr),
                *((name, _i64) for name in ("k_block_stride", "k_head_stride", "v_block_stride", "v_head_stride")),
                ("k_bits", _i32), ("v_bits", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [*((name, _ptr) for name in ("positions", "rope_positions", "hidden_keys", "seq_ids", "slots", "table",
                                           "cos", "sin", "residual", "pending", "scratch")),
                *((name, _i32) for name in ("n_layers", "rows", "hidden", "n_heads", "n_kv_heads", "dim", "half",
                                            "neox", "block_shift", "table_width", "threads")),
                ("eps", _f32), ("scale", _f32)]


def _matrix(w: QuantWeight) -> tuple[_Matrix, quant_cpu.CallPlan]:
    plan = quant_cpu.call_plan(w, "int8")
    return _Matrix(plan.w_ptr, plan.sm_ptr, plan.perm_ptr, *plan.shape_args), plan


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


class WholeLayers:
    """Runs a step's layers through cpu_layers (`__call__` says False where the step does not qualify)."""

    def __init__(self, layers: list[tuple[NormQKVRope, LinearAdd, NormFeedForwardAdd]]) -> None:
        self.layers = layers
        first = layers[0][0]
        self.n_heads, self.n_kv_heads, self.dim = first.n_heads, first.n_kv_heads, first.head_dim
        self.cos, self.sin = first.cos, first.sin
        self.plans: list[quant_cpu.CallPlan] = []  # kept alive: the structs hold their tensors' addresses
        self.weights = (_Layer * len(layers))()
        for i, (qkv, out, ffn) in enumerate(layers):
            matrices = [_matrix(w) for w in (qkv.w, out.w, ffn.w_gate_up, ffn.w_down)]  # type: ignore[arg-type]
            self.plans += [plan for _, plan in matrices]
            lw = self.weights[i]
            lw.attn_norm, lw.ffn_norm = qkv.norm.data_ptr(), ffn.norm.data_ptr()
            lw.qkv_bias = None if qkv.bias is None else qkv.bias.data_ptr()
            lw.qkv, lw.o, lw.gate_up, lw.down = (m for m, _ in matrices)
        self._caches: tuple[int, int] | None = None  # the pool the structs point into

    @classmethod
    def build(cls, layer_ops: Sequence[Sequence[StepOp]]) -> WholeLayers | None:
        """The whole-layer call for these layers' ops, or None where some layer is not the dense one it runs."""
        if not layer_ops or not build.has("cpu_layers"):
            return None
        layers = []
        for ops in layer_ops:
            if len(ops) != 3 or not all(isinstance(op, kind) for op, kind in
                                        zip(ops, (NormQKVRope, LinearAdd, NormFeedForwardAdd), strict=True)):
                return None
            qkv, out, ffn = ops
            assert isinstance(qkv, NormQKVRope) and isinstance(out, LinearAdd) and isinstance(ffn, NormFeedForwardAdd)
            matrices = (qkv.w, out.w, ffn.w_gate_up, ffn.w_down)
            packed = all(isinstance(w, QuantWeight) and w.bits in (4, 8) and w.words.device.type == "cpu"
                         and w.group * w.bits // 32 in (2, 4, 8, 16) for w in matrices)
            plain = (qkv.head_norms is None and qkv.adapters is None and out.adapters is None
                     and ffn.gate_up_adapters is None and ffn.down_adapters is None
                     and qkv.style in ("neox", "interleaved") and qkv.head_dim <= 256
                     and qkv.n_heads % qkv.n_kv_heads == 0 and qkv.n_heads // qkv.n_kv_heads <= 256)
            tensors = all(_fp32(t) for t in (qkv.norm, ffn.norm, qkv.bias, qkv.cos, qkv.sin))
            if not (packed and plain and tensors):
                return None
            layers.append((qkv, out, ffn))
        shapes = {(q.w.shape, o.w.shape, f.w_gate_up.shape, f.w_down.shape, q.eps, f.eps) for q, o, f in layers}
        return cls(layers) if len(shapes) == 1 else None

    def _point_at(self, caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """The layers' cache fields, set once per pool; False where the C code does not read its rows."""
        key = (caches[0][0].data_ptr(), caches[0][1].data_ptr())
        if key == self._caches:
            return True
        if not all(cpu_ops.paged(k, v, self.dim) for k, v in caches):
            return False
        for lw, (k, v) in zip(self.weights, caches, strict=True):
            lw.k_data, lw.k_block_stride, lw.k_head_stride, lw.k_bits = cpu_ops.cache_args(k, self.dim)
            lw.v_data, lw.v_block_stride, lw.v_head_stride, lw.v_bits = cpu_ops.cache_args(v, self.dim)
        self._caches = key
        return True

    def __call__(self, stream: ResidualStream, positions: torch.Tensor, seq_ids: torch.Tensor,
                 caches: Sequence[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor,
                 table: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """All layers on the stream (its residual replaced, the last output left pending), or False untouched.
        tree: a token tree step's rotary positions and hidden bits (KVStep.rope_positions, KVStep.hidden)."""
        x = stream.residual
        if (stream.pending is not None or stream.adapter_scales is not None or not settings().cpu_layers
                or quant_cpu.exact() or not _fp32(x) or x.shape[0] == 0
                or not (positions.dtype == seq_ids.dtype == slots.dtype == torch.int64)
                or not (positions.is_contiguous() and seq_ids.is_contiguous() and slots.is_contiguous())
                or table.dtype != torch.int32 or not table.is_contiguous() or not self._point_at(caches)):
            return False
        residual, pending = x.clone(), torch.empty_like(x)
        rows, block_size = x.shape[0], caches[0][0].shape[2]
        rope, hidden = tree if tree is not None else (positions, None)
        step = _Step(positions.data_ptr(), rope.data_ptr(), None if hidden is None else hidden.data_ptr(),
                     seq_ids.data_ptr(), slots.data_ptr(), table.data_ptr(),
                     self.cos.data_ptr(), self.sin.data_ptr(), residual.data_ptr(), pending.data_ptr(), None,
                     len(self.layers), rows, x.shape[1], self.n_heads, self.n_kv_heads, self.dim,
                     self.cos.shape[-1], self.layers[0][0].style == "neox", block_size.bit_length() - 1,
                     table.shape[1], torch.get_num_threads(), self.layers[0][0].eps, self.dim ** -0.5)
        lib = build.library()
        assert lib is not None
        scratch = torch.empty(lib.cpu_layers_scratch(self.weights, ctypes.byref(step)), dtype=torch.float32)
        step.scratch = scratch.data_ptr()
        if lib.cpu_layers(self.weights, ctypes.byref(step)):
            raise MemoryError("the CPU layers could not allocate a kernel's scratch")
        stream.residual, stream.pending = residual, pending
        return True


def whole_layers(kernels: TorchKernels, layer_ops: Sequence[Sequence[StepOp]]) -> WholeLayers | None:
    """The one-call layers for a model with these kernels and its layers' ops; None: the model calls them op by
    op (other kernels, or layers the C code does not run)."""
    return WholeLayers.build(layer_ops) if isinstance(kernels, CpuKernels) else None
