"""Quantized matrix-vector products on the CPU: QuantWeight read as packed integers, never widened to an fp32
matrix, by small C kernels (cpu/, built at first use by cpu/build.py). Decode reads 4 or 8 bits a weight instead
of 32.

Two kernels, chosen here per product (callers never choose):
- int8 (cpu/gemv_i8.c, the default): each activation row is rounded to int8 once per call, with one scale per
  weight word's k (8 values for 4-bit fields, 4 for 8-bit), or per weight group where the kernel's grouped
  layouts run (`grouped`: AVX-512's blocks of 4-word groups, AVX2's spans of 4- or 8-word groups), and
  multiplied as integers (vpdpbusd on AVX-512 VNNI, exact 16-bit multiply-adds on AVX2), as llama.cpp does:
  the product of W with the rounded activations.
  Approximate: docs/perf.md (2026-12-03, how far the int8 products move the model) gives its logit error and
  greedy agreement.
- fp32 (cpu/gemv_q.c): exact integers times fp32 activations (relative error ~4e-7 against the dequantized
  product). Taken with SPECSERVE_CPU_EXACT=1.
Both are built for AVX-512 VNNI or for AVX2 + FMA + F16C, whichever the CPU has (cpu/build.py).
Rounding is discontinuous: a 1e-7 difference in an input can move a product by a rounding step, so the int8
kernel takes every row count (prompt chunks too) and the ops around it compute each row on its own (cpu_ops):
a row's result is then the same bit for bit in any batch, and greedy text does not depend on the batch or on
speculation (spec/server.md).
Where there is no compiler or neither instruction set, or SPECSERVE_CPU_KERNEL=0, `available()` says no and the
product dequantizes instead (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

from specserve.kernels.cpu import build
from specserve.kernels.settings import settings

if TYPE_CHECKING:
    from specserve.kernels.quant_weight import QuantWeight

MAX_ROWS = 16  # rows one kernel call takes (more run in slices)
MAX_EXACT_ROWS = 64  # the most rows the exact kernel takes (the int8 one takes any)


def int8_built() -> bool:
    """Whether this machine runs the int8 kernel (wherever the library builds: AVX-512 VNNI or AVX2)."""
    return build.has("q_gemv_i8")


def kernel_built() -> bool:
    """Whether this machine runs the packed-weight kernels (AVX-512 VNNI or AVX2 + FMA + F16C, a compiler; built
    now if they were not)."""
    return build.has("q_gemv")


def available(x: torch.Tensor, w: QuantWeight, kernel: str | None = None) -> bool:
    """Whether x @ W^T runs here. The int8 kernel takes every row count: a row's result must not depend on the
    batch it is in (a prompt chunk or a decode step, alone or beside other requests), and its per-row rounding
    and accumulation make it the same in any. The exact kernel takes up to MAX_EXACT_ROWS; above that
    dequantizing for torch's GEMM is faster (prefill) and exact too. A group's words must divide a chunk's 16
    and be 2 or more (every group of 16 or 32: simd.h's tables hold 4 groups a vector on AVX2)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and w.words.device.type == "cpu"
            and w.bits in (4, 8) and w.group * w.bits // 32 in (2, 4, 8, 16) and kernel_built()):
        return False
    return x.numel() // x.shape[-1] <= MAX_EXACT_ROWS or (kernel or kernel_for(w)) == "int8"


@cache
def _permutation(k: int, bits: int, group: int) -> tuple[torch.Tensor, int]:
    """The k of each slot of the kernel's [chunks, fields, 16] activation order (-1 past K), int32."""
    words_per_group = group * bits // 32
    fields = 32 // bits
    n_words = k * bits // 32
    chunks = -(-n_words // 16)
    c = torch.arange(chunks).view(-1, 1, 1)
    i = torch.arange(fields).view(1, -1, 1)
    lane = torch.arange(16).view(1, 1, -1)
    word = 16 * c + lane
    index = (word // words_per_group) * group + i * words_per_group + word % words_per_group
    index = torch.where(word < n_words, index, torch.full_like(index, -1))
    return index.reshape(-1).to(torch.int32).contiguous(), chunks


@cache
def _layout(bits: int, group: int) -> int:
    """The int8 kernel's layout for this format here (gemv_i8.c's q_i8_grouped): 0 a scale a word, 1 AVX-512's
    grouped blocks, 2 AVX2's spans (the ordinary chunk order)."""
    lib = build.library()
    return int(lib.q_i8_grouped(group * bits // 32)) if lib is not None and hasattr(lib, "q_i8_grouped") else 0


def grouped(bits: int, group: int) -> bool:
    """Whether the int8 kernel rounds this format's activations with one scale a weight group here."""
    return _layout(bits, group) != 0


@cache
def _grouped_permutation(k: int, bits: int, group: int) -> tuple[torch.Tensor, int]:
    """The k of each slot of the grouped layout (gemv_i8.c's grouped_shape), int32, -1 past K: [blocks, 4 words,
    fields, 16 groups] for whole blocks of 16 groups (and a last one of 8 or more), then [tail chunks, fields,
    16 words] for the words of fewer left over; and the number of blocks."""
    assert group * bits // 32 == 4
    fields, n_groups = 32 // bits, k // group
    rest = n_groups % 16
    blocks = n_groups // 16 + (rest >= 8)
    b = torch.arange(blocks).view(-1, 1, 1, 1)
    j = torch.arange(4).view(1, -1, 1, 1)
    i = torch.arange(fields).view(1, 1, -1, 1)
    g = 16 * b + torch.arange(16).view(1, 1, 1, -1)
    in_blocks = torch.where(g < n_groups, g * group + i * 4 + j, torch.full_like(g, -1)).reshape(-1)
    tail_chunks = 0 if rest >= 8 else -(-4 * rest // 16)
    word = 64 * blocks + 16 * torch.arange(tail_chunks).view(-1, 1, 1) + torch.arange(16).view(1, 1, -1)
    i = torch.arange(fields).view(1, -1, 1)
    tail = torch.where(word < 4 * n_groups, (word // 4) * group + i * 4 + word % 4, torch.full_like(word, -1))
    return torch.cat([in_blocks, tail.reshape(-1)]).to(torch.int32).contiguous(), blocks


def quantize_activations_ref(x: torch.Tensor, bits: int, group: int,
                             per_group: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's rounding of x [rows, K]: blocks of each weight word's k ([rows, words, fields]),
    q = round(x / dx) with dx = max |x| / 127 per block (fp32, ties to even, as the kernel) -> (q, dx).
    per_group (the grouped layout): dx per weight group, the same for each of its words."""
    rows, k = x.shape
    fields, words_per_group = 32 // bits, group * bits // 32
    blocks = x.float().view(rows, k // group, fields, words_per_group).transpose(2, 3).reshape(rows, -1, fields)
    dx = blocks.abs().amax(-1) / 127.0
    if per_group:
        dx = dx.view(rows, -1, words_per_group).amax(-1).repeat_interleave(words_per_group, dim=1)
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return (blocks * inv[..., None]).round().clamp(-127, 127), dx


def gemv_int8_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The int8 kernel's arithmetic in torch (fp64 sums): per word, its integers times the rounded activations
    scaled by scale * dx, minus min times the rounded activations' sum (dx * sum of q); dx per word or, where the
    kernel runs grouped, per group. x [rows, K] -> [rows, N]."""
    from specserve.kernels.quant_weight import unpack

    n, k = w.shape
    q, dx = quantize_activations_ref(x, w.bits, w.group, grouped(w.bits, w.group))
    fields, words_per_group = 32 // w.bits, w.group * w.bits // 32
    u = unpack(w.words, w.bits, w.group).view(n, k // w.group, fields, words_per_group).transpose(2, 3)
    u = u.reshape(n, -1, fields).double()
    dots = torch.einsum("mwf,nwf->mnw", q.double(), u)  # exact: integers well below 2^53
    word_group = torch.arange(u.shape[1]) // words_per_group
    sm = w.sm.double()[:, word_group]  # [n, words, 2]
    q_sums = q.double().sum(-1) * dx.double()  # [rows, words]
    y = (dots * sm[None, :, :, 0] * dx.double()[:, None, :]).sum(-1) - q_sums @ sm[:, :, 1].t()
    return y.float()


def exact() -> bool:
    """SPECSERVE_CPU_EXACT=1: every product on the exact fp32 kernel (kernels/settings.py; read per product, so
    tests and benchmarks can switch with settings.reload())."""
    return settings().cpu_exact


def kernel_for(w: QuantWeight) -> str:
    """"int8" or "fp32": the kernel `gemv` runs for w on this machine now (both take 4- and 8-bit fields)."""
    return "int8" if w.bits in (4, 8) and not exact() and int8_built() else "fp32"


@dataclass(frozen=True)
class CallPlan:
    """What one weight's calls of one kernel pass besides the activations: resolved once (`call_plan`)."""

    fn: Callable[..., int]
    w_ptr: int
    sm_ptr: int
    perm: torch.Tensor  # kept alive: the kernel reads it through perm_ptr
    perm_ptr: int
    n: int
    k: int
    shape_args: tuple[int, ...]  # n, k, words per row, groups per row, bits, words per group, chunks
    scratch_floats: int  # the fp32 kernel's scratch per row


_plans: dict[tuple, CallPlan] = {}
MAX_PLANS = 1 << 16  # every matrix of a large model, its experts one by one; past it the cache starts over


def call_plan(w: QuantWeight, kernel: str) -> CallPlan:
    """The call plan of w (keyed by its tensors' addresses and shapes, so a weight moved or replaced gets a new
    one): a decode step of a 135M model makes ~120 products, and resolving all this per call was twice the
    kernel's own time on its small matrices."""
    key = (w.words.data_ptr(), w.sm.data_ptr(), w.words.shape, w.bits, w.group, kernel)
    plan = _plans.get(key)
    if plan is None:
        lib = build.library()
        assert lib is not None and (kernel != "int8" or int8_built()), f"no {kernel} CPU kernel on this machine"
        if not (w.words.is_contiguous() and w.sm.is_contiguous()):
            raise ValueError("packed weights must be contiguous")
        n, words_per_row = w.words.shape
        k = words_per_row * 32 // w.bits
        blocks = kernel == "int8" and _layout(w.bits, w.group) == 1
        perm, chunks = (_grouped_permutation if blocks else _permutation)(k, w.bits, w.group)
        plan = CallPlan(lib.q_gemv_i8 if kernel == "int8" else lib.q_gemv, w.words.data_ptr(), w.sm.data_ptr(), perm,
                     perm.data_ptr(), n, k, (n, k, words_per_row, w.sm.shape[1], w.bits, w.group * w.bits // 32,
                                             chunks), perm.numel() + chunks * 16)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def product(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
            silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """A linear product on these kernels (silu_mul of x first where given: x is then [gate | up]), or None where
    they do not take it (`available`: also for how many rows)."""
    kernel = kernel_for(w)  # (once a product: it reads the environment)
    if not available(x, w, kernel):  # (row count, dtype and device: the same before and after SwiGLU)
        return None
    y = gemv(x if silu_mul is None else silu_mul(x), w, kernel)
    y = y if bias is None else y + bias
    return y if out_dtype is None else y.to(out_dtype)


def gemv(x: torch.Tensor, w: QuantWeight, kernel: str | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ W^T -> fp32 [..., N] on torch's thread count. kernel: None chooses (`kernel_for`); tests
    name one. Kept lean: a 135M model's decode step makes ~120 of these calls."""
    kernel = kernel or kernel_for(w)
    plan = call_plan(w, kernel)
    n, k = plan.n, plan.k
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    rows_total = flat.shape[0]
    out = torch.empty(rows_total, n, dtype=torch.float32)
    args = (*plan.shape_args, torch.get_num_threads())
    x_ptr, out_ptr = flat.data_ptr(), out.data_ptr()
    if kernel == "int8":
        for start in range(0, rows_total, MAX_ROWS):
            rows = min(MAX_ROWS, rows_total - start)
            if plan.fn(plan.w_ptr, plan.sm_ptr, x_ptr + 4 * start * k, plan.perm_ptr, out_ptr + 4 * start * n, rows,
                       *args):
                raise MemoryError("the int8 CPU kernel could not allocate its activation scratch")
    else:
        scratch = torch.empty(min(MAX_ROWS, rows_total) * plan.scratch_floats, dtype=torch.float32)
        for start in range(0, rows_total, MAX_ROWS):
            rows = min(MAX_ROWS, rows_total - start)
            plan.fn(plan.w_ptr, plan.sm_ptr, x_ptr + 4 * start * k, plan.perm_ptr, scratch.data_ptr(),
                    out_ptr + 4 * start * n, rows, *args)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
