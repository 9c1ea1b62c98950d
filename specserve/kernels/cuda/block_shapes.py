"""Block shapes and shared-memory layout of the quantized GEMV kernels (gemv_q.cu, gemv_mma.cu).

Every parameter that sets the order of a row's sums (how many warps split K, how far ahead they load,
how many blocks of a cluster split K) follows the matrix shape only, never the row count, so a verify
step of several rows computes bit for bit what one-row decode steps compute. Only which warps share a
block and the register bound may follow the row count. The rules come from H200 sweeps over
qwen2.5-coder-1.5b's shapes (benchmarks/kernel_bench.py --sections matrices).
"""

from __future__ import annotations

from functools import cache

import torch

CORE_WARPS = 8  # warps per gemv_q block
SMEM_BYTES = 48 * 1024  # staged activations per gemv_q block, without opting in to more
MMA_SMEM_BYTES = 200 * 1024  # gemv_mma opts in to more (H100/H200: up to 227 KB per block)


def pick_cuda_blocks(k: int) -> dict[str, int]:
    """gemv_q: output rows per warp (RN), groups in flight per lane (U), warps splitting K (KSPLIT).
    RN 2, U 1 was best or within reach of the best for one and eight rows; KSPLIT depends on the
    shape only."""
    return {"RN": 2, "U": 1, "KSPLIT": 2 if k >= 4096 else 1}


def pick_mma_blocks(n: int, k: int, rows: int = 1, clusters: bool = False, q8: bool = False) -> dict[str, int]:
    """gemv_mma: 16-row tiles per block (TILES), warps splitting K (KSPLIT), groups in flight per warp (D),
    blocks of a cluster splitting K (KC) and MINB, the blocks per SM the registers must leave room for (0: as
    many as put the grid in one wave, `one_wave_blocks`). KSPLIT, D and KC come from the shape only (and from
    `clusters`: sm_90+ and no RMSNorm folded in).

    down's shape (few tiles, long K) splits K four ways across a cluster: one row costs a little more,
    6-16 rows clearly less, since each block stages only a quarter of K for every row; two tiles a block
    up to 2 rows, four above. Several rows take more registers than one, so without a bound gate_up's
    blocks would need a second wave, and MINB bounds them to one. Three tiles per block for mid-size
    matrices (gate_up) balance the SMs better than two and stage the activations fewer times.

    q8 (8-bit words of full range, Q8_0's: twice the bytes of a Q4 row) has rules of its own with clusters,
    from the H200 sweep over Qwen3-30B-A3B's dense products (`kernel_bench.py --matrix-set qwen3moe`, us at 1 /
    8 rows, the Q4 rules -> these): wqkv 5120 x 2048 14.0 / 14.8 -> 7.9 / 11.0, wo 2048 x 4096 10.4 / 12.8 ->
    6.6 / 7.2, the output head 151936 x 2048 121.2 -> 116.1 at one row."""
    n_tiles = -(-n // 16)
    if q8 and clusters:
        if n_tiles <= 256 and k >= 4096:
            return {"TILES": 1, "KSPLIT": 8, "D": 2, "KC": 2, "MINB": 0}
        if n_tiles <= 2048:
            return {"TILES": 2, "KSPLIT": 4, "D": 2, "KC": 2, "MINB": 0}
        return {"TILES": 2 if rows <= 2 else 8, "KSPLIT": 2, "D": 1, "MINB": 0}
    if n_tiles <= 256 and k >= 4096 and clusters:
        return {"TILES": 2 if rows <= 2 else 4, "KSPLIT": 4, "D": 2, "KC": 4, "MINB": 0}
    if n_tiles <= 256:  # few tiles (wqkv, wo, down): one per block, 16 warps splitting K; unbounded (one wave
        return {"TILES": 1, "KSPLIT": 16, "D": 2, "MINB": 1}  # on an H200, and 512 threads would spill under a bound)
    if n_tiles <= 2048:
        return {"TILES": 3, "KSPLIT": 2, "D": 2, "MINB": 0}
    return {"TILES": 8, "KSPLIT": 2, "D": 1, "MINB": 0}


def pick_expert_blocks() -> dict[str, int]:
    """gemv_mma's expert pairs (one row each, a small matrix per pair: Qwen3-30B-A3B's gate|up 1536 x 2048 and
    down 2048 x 768): two tiles a block, two warps splitting K, no cluster. From the H200 sweep of
    benchmarks/moe_bench.py's experts section (1 / 16 tokens, us: gate|up 11.7 / 150.2, down 6.7 / 78.7; the dense
    rule's one tile and 16 warps: 42.8 / 591.7 for both with the slot sum). The same for any number of pairs, so
    a pair's sums do not depend on the batch."""
    return {"TILES": 2, "KSPLIT": 2, "D": 1, "KC": 1, "MINB": 0}


@cache
def sm_resources(device: int) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes per multiprocessor)."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)


def one_wave_blocks(grid: int, threads: int, smem: int, device: int) -> int:
    """Blocks per SM the kernel's registers must leave room for so that the grid runs in one wave (1
    where it does anyway), but never fewer than 64 registers a thread (the output matrix: 2), nor more
    blocks than the shared memory holds (a bound past that only makes the kernel spill: gate_up's
    staged rows take 41 KB a block at 9 rows, 66 KB at 16)."""
    sms, smem_per_sm = sm_resources(device)
    if grid <= sms:
        return 1
    by_smem = smem_per_sm // (smem + 1024)  # the driver reserves 1 KB per block
    return max(1, min(-(-grid // sms), 65536 // (64 * threads), by_smem))


def chunk_groups(n_rows: int, k: int, group: int, ksplit: int) -> int:
    """gemv_q: groups staged at a time: all of K if it fits, else preferably a multiple of the 32 * KSPLIT
    groups one pass of a row set covers (fewer idle lanes)."""
    n_groups = k // group
    fit = SMEM_BYTES // (n_rows * (group + 4) * 4)
    if fit >= n_groups:
        return n_groups
    step = 32 * ksplit
    return max(step, fit // step * step) if fit >= step else max(8, fit // 8 * 8)


def k_share(k: int, group: int, per_step: int, kc: int) -> int:
    """The activations a block of a KC-block cluster stages: its share of whole steps of per_step groups."""
    return -(-(k // group // per_step) // kc) * per_step * group


def mma_chunk(n_rows: int, k: int, group: int, step: int, sums: int = 1) -> tuple[int, int]:
    """gemv_mma: groups staged at a time (a multiple of `step`, the groups the warps of a tile take per
    round) and bytes per staged activation row: groups of bf16 values padded by a quarter (the kernel's GP),
    then one group's bytes more, so the lanes of two rows hit distinct banks. After the rows, `sums`
    arrays of fp32 per-group sums (16 rows): the activations' sums, and with RMSNorm their sums of
    squares."""
    def row_bytes(cg: int) -> int:
        return -(-cg * group * 5 // 2 // 128) * 128 + group * 2

    cg = -(-(k // group) // step) * step
    while cg > step and n_rows * row_bytes(cg) + cg * 64 * sums > MMA_SMEM_BYTES:
        cg -= step
    return cg, row_bytes(cg)
