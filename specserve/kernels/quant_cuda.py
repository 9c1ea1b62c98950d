"""CUDA C matrix-vector products over bit-packed quantized weights (QuantWeight), few rows, bf16.

Two kernels (kernels/cuda/*.cu); both compute every (output row, activation row) pair with the same
instruction sequence whatever the row count, so a verify step of 8 rows computes bit for bit what 8
one-row decode steps compute (tests/test_kernels.py checks this), and speculative greedy text equals
plain greedy text.

`gemv_mma` (the default on sm_80+): tensor cores on exact integers. A warp owns 16 output rows
and multiplies them with up to 16 activation rows by mma.sync m16n8k16 (weights as A, bf16):
- a lane loads 16 bytes of each of its two rows per step (a quad of lanes: 64 contiguous bytes)
  and the quad swaps words (quad_transpose) so each lane holds the words its fragments take;
- a 4-bit field (or an 8-bit one below 128, `QuantWeight.u_max`) becomes an exact bf16 integer
  under bf16's exponent of 128 (LOP3) minus 128 (one bf16x2 FMA); wider bytes go through fp32;
- the fp32 partial of each group is scaled once: acc += scale * partial - min * sum(x), the
  activations' group sums computed while staging them;
- activations are staged in shared memory as bf16 (SwiGLU of a [gate | up] input applied
  there), permuted so a lane reads its B fragment in one load.
For the fused decode path (model/transformer.py) it also folds in, by compile-time flags: RMSNorm
of its input (NORM: x * weight staged, 1/rms from per-group sums of squares scales the sums at the
end), SwiGLU of its output (SWIGLU: a tile pairs gate rows with their up rows), the residual add
(ACCUM: out += product, in place) and RoPE with the KV-cache write (ROPE: a tile pairs rotation
partners; `RopeWrite`). On sm_90 it is launched as a programmatic dependent (`build.launch`):
weights load before `griddepcontrol.wait`, activations after it. On sm_90+ the blocks of a thread-block
cluster may split K (KC): each stages and multiplies a contiguous share of whole steps, and the cluster's
first block adds the others' sums, in rank order, from their shared memory before its epilogue.
`gemv_q`: CUDA cores. A lane walks whole groups of one row (one 16-byte load), a bit field
becomes the fp32 value 1 + u / 2^bits by moving it under 1.0's exponent, and per group
s * sum(u x) - min * sum(x) is recovered from sum((1 + u / 2^bits) x) and sum(x). It also takes
4-bit groups of 16 and row lengths the MMA kernel's 16-word steps do not divide.

One row costs about the same on either kernel; several rows cost the tensor-core kernel little more
than one, the CUDA cores several times one, hence the default. Each variant (integer width, rows,
blocks, fusion flags) is compiled at first use (`cuda.build`). Where that is not available, or for
other dtypes, `usable` says no and the Triton kernels (linear_triton.py) run instead.
SPECSERVE_QUANT_KERNEL=core|triton picks another kernel (for A/B runs; callers never choose).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import cache

import torch

from specserve.kernels.cuda import block_shapes, build
from specserve.kernels.quant_weight import MAX_GEMV_ROWS, QuantWeight
from specserve.kernels.rope import RopeWrite
from specserve.kernels.settings import settings

ROWS_PER_LAUNCH = MAX_GEMV_ROWS  # the kernels' largest M: more rows run as slices of this many


def kernel_choice() -> str:
    """SPECSERVE_QUANT_KERNEL: "mma" (tensor cores, the default), "core" (CUDA cores) or "triton"."""
    return settings().quant_kernel


@cache
def _available(name: str) -> bool:
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False
    probe = {"gemv_q": ("gemv_q", 4, 4, 1, 1, 1, 1, False, False, False),
             "gemv_mma": ("gemv_mma", 4, 32, 1, 1, 1, 1, *[False] * 7, 0, 0, 1, 1, 0)}[name]
    try:
        build.prebuild([probe])  # one small variant, not all 16 row counts
    except Exception:  # no NVRTC, or a compiler that refuses the source: the Triton kernels run instead
        return False
    return True


def _usable(x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and out_dtype in (torch.bfloat16, torch.float32)
            and (bias is None or bias.dtype == torch.bfloat16) and x.shape[-1] % 8 == 0)


def usable(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> str | None:
    """The CUDA kernel that takes this product ("gemv_mma" or "gemv_q"), or None (the Triton ones).

    bf16 activations on CUDA, an input size in whole 8-value steps, a working NVRTC; the tensor-core
    kernel needs groups of 4 or 8 words (4-bit / 32, 8-bit / 16 or 32), whole 16-word steps per row
    and an sm_80 or newer GPU."""
    if kernel_choice() == "triton" or not _usable(x, bias, out_dtype):
        return None
    return _weight_kernel(w, x.device)


def _weight_kernel(w: QuantWeight, device: torch.device) -> str | None:
    wpg = w.group * w.bits // 32
    n_groups = w.shape[1] // w.group
    if (kernel_choice() == "mma" and wpg in (4, 8) and n_groups % (16 // wpg) == 0
            and build.tensor_cores(device.index or 0) and _available("gemv_mma")):
        return "gemv_mma"
    return "gemv_q" if wpg in (2, 4, 8) and _available("gemv_q") else None


def experts_usable(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight) -> bool:
    """Whether `expert_gemv` takes both expert products (gate|up with its SwiGLU, then down) for x: bf16 on
    CUDA, both matrices on the tensor-core kernel, an expert feed-forward size in whole 8-row tiles."""
    ffn = down.shape[1]
    return (kernel_choice() != "triton" and _usable(x, None, x.dtype) and ffn % 8 == 0
            and all(_weight_kernel(w, x.device) == "gemv_mma" for w in (gate_up, down)))


def norm_fusable(w: QuantWeight) -> bool:
    """The tensor-core kernel stages all of K at once for 16 rows (RMSNorm needs whole rows)."""
    cfg = block_shapes.pick_mma_blocks(*w.shape)
    per_step = cfg["D"] * cfg["KSPLIT"] * 512 // (w.group * w.bits)
    cg, _ = block_shapes.mma_chunk(ROWS_PER_LAUNCH, w.shape[1], w.group, per_step, 2)
    return cg * w.group >= w.shape[1]


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    return x2


def gemv(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool, out_dtype: torch.dtype,
         blocks: dict[str, int] | None = None, kernel: str | None = None, *, swiglu_output: bool = False,
         norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
         rope: RopeWrite | None = None) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype.

    Up to 16 rows per launch; more rows run as 16-row slices into one output, so each row gets the
    same sums as in a one-row call. `kernel`: "gemv_mma" or "gemv_q" (default: what `usable` picks);
    `blocks`: that kernel's blocks. The tensor-core kernel also folds in (bf16 in and out):
    swiglu_output: W = [gate | up] -> silu(gate) * up [.., N / 2], each rounded as silu_input rounds;
    norm (weight, eps): RMSNorm of the input rows first, when `norm_fusable` (rounded as rms_norm);
    add_to: a contiguous [.., N] tensor that the product is added to in place (a residual stream),
    which is returned; rope: W = [q | k | v] heads: returns q rotated [.., n_heads * head_dim], k (rotated)
    and v go into the KV cache at the rows' pool slots, rounded as rope_and_cache rounds."""
    lead = x.shape[:-1]
    x2 = _flat_rows(x)
    n_out, k = w.shape
    assert x2.shape[1] == (2 * k if silu_input else k)
    kernel = kernel or usable(x2, w, bias, out_dtype)
    assert kernel, "no CUDA kernel takes this product (see usable)"
    fused = (swiglu_output, norm is not None, add_to is not None, rope is not None)
    assert not any(fused) or (kernel == "gemv_mma" and not silu_input)
    assert not (swiglu_output or add_to is not None or rope is not None) or out_dtype == torch.bfloat16
    if rope is not None:
        assert not swiglu_output and add_to is None and n_out == (rope.n_heads + 2 * rope.n_kv_heads) * rope.head_dim
        c = rope.k_cache  # [blocks, kv heads, block size (a power of two), head_dim]
        assert rope.head_dim % 16 == 0 and 2 * rope.cos.shape[-1] == rope.head_dim
        assert c.stride(2) == rope.head_dim and c.stride(3) == 1 and c.stride() == rope.v_cache.stride()
        assert c.shape[2] & (c.shape[2] - 1) == 0
        n_out = rope.n_heads * rope.head_dim
    if swiglu_output:
        assert bias is None and add_to is None and n_out % 16 == 0
        n_out //= 2
    assert norm is None or (norm_fusable(w) and norm[0].dtype == torch.bfloat16)
    if add_to is not None:
        assert add_to.is_contiguous() and add_to.dtype == torch.bfloat16 and add_to.numel() == x2.shape[0] * n_out
        out = add_to.view(x2.shape[0], n_out)
    else:
        out = torch.empty((x2.shape[0], n_out), dtype=out_dtype, device=x.device)
    rows, start = x2.shape[0], 0
    if kernel == "gemv_mma" and rows >= 2 * ROWS_PER_LAUNCH:  # whole 16-row slices in one launch (block rows)
        start = rows // ROWS_PER_LAUNCH * ROWS_PER_LAUNCH
        _launch_mma(x2[:start], w, bias, silu_input, out[:start], blocks, fused, norm,
                    rope.rows(0, start) if rope is not None else None, slices=start // ROWS_PER_LAUNCH)
    _each_slice(_launch_mma if kernel == "gemv_mma" else _launch_core, x2, w, bias, silu_input, out, blocks, fused,
                norm, rope, start)
    return out.view(*lead, n_out)


def _each_slice(launch_rows: Callable[..., None], x2: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
                silu_input: bool, out: torch.Tensor, blocks: dict[str, int] | None, fused: tuple[bool, ...],
                norm: tuple[torch.Tensor, float] | None, rope: RopeWrite | None, start: int = 0) -> None:
    """A launch per slice of up to 16 rows of x2 from `start` on."""
    for i in range(start, x2.shape[0], ROWS_PER_LAUNCH):
        end = i + ROWS_PER_LAUNCH
        launch_rows(x2[i:end], w, bias, silu_input, out[i:end], blocks, fused, norm,
                    rope.rows(i, end) if rope is not None else None)


def _flags(silu_input: bool, bias: torch.Tensor | None, out: torch.Tensor) -> tuple[bool, bool, bool]:
    """Both kernels' (SILU, BIAS, OUT_F32)."""
    return silu_input, bias is not None, out.dtype == torch.float32


def expert_gemv(x: torch.Tensor, ids: torch.Tensor, w: QuantWeight, n_expert: int, out_dtype: torch.dtype, *,
                by_token: bool, swiglu_output: bool = False, blocks: dict[str, int] | None = None) -> torch.Tensor:
    """Mixture-of-experts pairs on the tensor-core kernel: for pair p (= token * k + slot, ids [n, k]),
    out[p] = x_row @ W_e^T with e = ids[p] and W_e expert e's [N, K] rows of the stacked w [n_expert * N, K];
    x_row is x[p // k] (by_token: gate|up) or x[p] (down). One row per pair (each pair's sums are its own, so a
    verify step computes what decode steps compute), read where the ids are, on the device: graph-safe.
    swiglu_output: W_e = [gate | up] -> silu(gate) * up, N / 2 wide. blocks: the kernel's (benchmark sweeps)."""
    n_pairs = ids.numel()
    x2 = _flat_rows(x)
    assert ids.dtype == torch.int64, "expert ids are int64"
    assert x2.shape[0] * (ids.shape[-1] if by_token else 1) == n_pairs and w.shape[0] % n_expert == 0
    n_rows = w.shape[0] // n_expert
    out = torch.empty((n_pairs, n_rows // 2 if swiglu_output else n_rows), dtype=out_dtype, device=x.device)
    if n_pairs:
        _launch_mma(x2, w, None, False, out, blocks, (swiglu_output, False, False, False), None, None,
                    experts=(ids.reshape(-1).contiguous(), n_expert, ids.shape[-1] if by_token else 1))
    return out


def _launch_mma(x2: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool, out: torch.Tensor,
                cfg_override: dict[str, int] | None, fused: tuple[bool, ...], norm: tuple[torch.Tensor, float] | None,
                rope: RopeWrite | None, experts: tuple[torch.Tensor, int, int] | None = None, slices: int = 1) -> None:
    """One tensor-core launch over 1..16 rows x2 [rows, K or 2K] into out [rows, N] (N / 2 with SwiGLU, q's
    width with RoPE; both row-contiguous), or over `slices` slices of 16 rows each (block rows: each slice as
    its own launch would compute it). fused: (SwiGLU output, RMSNorm input, add to out, RoPE and KV write).
    experts (ids [pairs] int64, n_expert, x rows per pair divisor): one row per pair (`expert_gemv`)."""
    n_out, k = w.shape
    n_pairs = 1
    if experts is not None:
        n_out //= experts[1]
        n_pairs = experts[0].numel()
    flags = _flags(silu_input, bias, out)
    per_step = 512 // (w.group * w.bits)  # groups in a lane's 16-byte load
    sums = 2 if fused[1] else 1
    seven_bits = w.bits == 8 and w.u_max < 128
    rope_flags = ({"neox": 1, "interleaved": 2}[rope.style], rope.head_dim) if rope is not None else (0, 0)
    n_tiles = -(-n_out // 16)
    device = x2.device.index or 0

    def variant(rows: int) -> tuple[tuple, dict[str, int], int, int, int, int]:
        """The key, blocks, grid, staged groups, bytes per staged row and shared memory for `rows` rows."""
        clusters = build.sm90(device) and not fused[1]  # RMSNorm takes whole rows
        shape = (block_shapes.pick_expert_blocks() if experts
                 else block_shapes.pick_mma_blocks(n_out, k, rows, clusters, q8=w.bits == 8 and not seven_bits))
        cfg = {**shape, **(cfg_override or {})}
        cfg["KC"] = cfg.get("KC", 1) if clusters else 1
        grid = -(-n_tiles // cfg["TILES"]) * cfg["KC"]
        threads = 32 * cfg["TILES"] * cfg["KSPLIT"]
        cg, row_bytes = block_shapes.mma_chunk(rows, block_shapes.k_share(k, w.group, per_step, cfg["KC"]), w.group,
                                         cfg["D"] * cfg["KSPLIT"] * per_step, sums)
        reduce_bytes = threads * (2 if rows > 8 else 1) * 16 if cfg["KSPLIT"] > 1 or cfg["KC"] > 1 else 0
        smem = max(rows * row_bytes + cg * 64 * sums, reduce_bytes)
        minb = cfg["MINB"] or block_shapes.one_wave_blocks(grid * n_pairs, threads, smem, device)
        return (("gemv_mma", w.bits, w.group, rows, cfg["TILES"], cfg["KSPLIT"], cfg["D"], *flags, seven_bits,
                 *fused[:3], *rope_flags, minb, cfg["KC"], experts[2] if experts else 0), cfg, grid, cg, row_bytes,
                smem)

    assert slices == 1 or (experts is None and x2.shape[0] == slices * ROWS_PER_LAUNCH and out.is_contiguous())
    key, cfg, grid, cg, row_bytes, smem = variant(1 if experts else x2.shape[0] // slices)
    built = build.kernel(key, (lambda rows: key) if experts else (lambda rows: variant(rows)[0]))
    norm_w, eps = norm if norm is not None else (x2, 0.0)
    eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]  # fp32 bits: the launcher passes floats as double
    no_rope = [x2, x2, x2, x2, x2, x2, 0, 0, 0, 0, 0]
    extra = [cg, row_bytes, norm_w, eps_bits, *(rope.args() if rope is not None else no_rope)]
    assert smem <= block_shapes.MMA_SMEM_BYTES, "activations too wide to stage"
    args = [x2, w.words, w.sm, bias if bias is not None else x2, out, n_out, k, x2.stride(0), *extra,
            experts[0] if experts else x2]
    build.launch(built, (grid, n_pairs * slices), 32 * cfg["TILES"] * cfg["KSPLIT"], args, smem,
                 build.pdl_enabled(device), cfg["KC"])


def _launch_core(x2: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool, out: torch.Tensor,
                 cfg_override: dict[str, int] | None, fused: tuple[bool, ...], norm: tuple[torch.Tensor, float] | None,
                 rope: RopeWrite | None) -> None:
    """One CUDA-core launch over 1..16 rows x2 [rows, K or 2K] into out [rows, N] (no fusions)."""
    n_rows = x2.shape[0]
    n_out, k = w.shape
    cfg = cfg_override or block_shapes.pick_cuda_blocks(k)
    cg = block_shapes.chunk_groups(n_rows, k, w.group, cfg["KSPLIT"])
    smem = max(n_rows * cg * (w.group + 4) * 4, block_shapes.CORE_WARPS * cfg["RN"] * n_rows * 4)
    built = build.kernel(("gemv_q", w.bits, w.group * w.bits // 32, n_rows, cfg["RN"], cfg["U"], cfg["KSPLIT"],
                          *_flags(silu_input, bias, out)))
    grid = -(-n_out // (block_shapes.CORE_WARPS // cfg["KSPLIT"] * cfg["RN"]))
    assert smem <= block_shapes.SMEM_BYTES, "activations too wide to stage"
    args = [x2, w.words, w.sm, bias if bias is not None else x2, out, n_out, k, x2.stride(0), cg]
    build.launch(built, grid, 32 * block_shapes.CORE_WARPS, args, smem)
