"""Triton attention over the paged KV cache (model/kv_cache.py; float or packed rows, kernels/kv_format.py),
flash-decoding style.

Every query row carries its own (sequence, position), so one launch serves any mix of
decode rows and multi-token verify rows of many sequences, and the launch shape depends
only on the row count: CUDA graphs can capture it. Each row's context (its position + 1, read
on the device) is cut into at most MAX_SPLITS splits of a whole number of key tiles; one program
handles splits of one (row, kv head) for all query heads of that kv head (GQA): a grid of fewer programs a
row the more rows a step has (each program takes every GRID_SPLITS-th split), and a second kernel
merges a row's splits by their log-sum-exp. So a row's work follows its own context, never the
pool's size or the table's width, and a row's result does not depend on the other rows (batch
invariant). Each key's slot comes from its sequence's block table row (a gather of BLOCK_N table
entries per inner step, from cache).

Prompt steps of many rows (TILED_MIN_ROWS; the caller says which steps read prompts) also take a tiled kernel: a
tile of consecutive rows of one sequence (a prompt chunk's) is one program per kv head and split of its keys that
reads each key tile once for all its rows, as flash attention's forward does, instead of once a row; the split
kernel skips those rows, and the merge kernel joins their splits. A row's result then depends on whether its tile
holds one sequence, so batch-invariant steps keep the row kernels alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.kv_format import format_of

BLOCK_N = 64  # keys per inner step
MAX_SPLITS = 64  # the merge holds every split of a row at once
TILED_MIN_ROWS = 64  # prompt steps of at least this many rows take the tiled kernel for their one-sequence tiles
TILE_QUERIES = 128  # query vectors (rows x heads of a kv head) in a tile: 16 rows of Qwen2.5-1.5B's 6 heads, padded
TILE_PROGRAMS = 512  # tile programs in a launch, at least (each one's work is a 16-row tile's, not a row's)
GRID_PROGRAMS = 2048  # split programs in a launch, at least: ~16 for each of the H100's / H200's 132 SMs
# A row of ctx positions takes splits of cdiv(ctx, MAX_SPLITS * BLOCK_N) key tiles: one tile (64 keys) up to 4,096
# positions, so a short row at small batch still spreads over many programs (each one latency-bound).


@triton.jit
def _load_rows(c_ptr, rows, d, mask, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Keys or values [BLOCK, HEAD_DIM] whose BLOCK rows start at `rows` (storage elements): float rows as stored
    (BITS 0), packed q8_0 / q4_0 rows (kernels/kv_format.py) decoded to fp32."""
    if BITS == 0:
        out = tl.load(c_ptr + rows[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    else:
        # a row's HEAD_DIM / 32 fp16 scales follow its HEAD_DIM * BITS / 8 code bytes: loaded once a group and
        # spread over the group's 32 values (not a load per value)
        g = tl.arange(0, HEAD_DIM // 32)
        scale_at = (c_ptr + rows[:, None] + HEAD_DIM * BITS // 8 + g[None, :] * 2).to(tl.pointer_type(tl.float16))
        group_scale = tl.load(scale_at, mask=mask[:, None], other=0.0).to(tl.float32)  # [BLOCK, HEAD_DIM / 32]
        scale = tl.reshape(tl.broadcast_to(group_scale[:, :, None], (BLOCK, HEAD_DIM // 32, 32)), (BLOCK, HEAD_DIM))
        if BITS == 8:
            codes = tl.load((c_ptr + rows[:, None] + d[None, :]).to(tl.pointer_type(tl.int8)), mask=mask[:, None],
                            other=0).to(tl.float32)
        else:  # value j is the low nibble of byte j, value j + HEAD_DIM / 2 its high nibble
            byte = tl.load(c_ptr + rows[:, None] + d[None, :] % (HEAD_DIM // 2), mask=mask[:, None],
                           other=0).to(tl.int32)
            codes = ((byte >> ((d[None, :] // (HEAD_DIM // 2)) * 4)) & 15).to(tl.float32) - 8.0
        out = codes * scale
    return out


@triton.jit
def _attend_keys(q, n, n_mask, visible, table, kc_ptr, vc_ptr, kv_head, d, scale, m_i, l_i, acc, stride_k_block,
                 stride_k_head, stride_v_block, stride_v_head, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr):
    """One key tile (positions n, those past the context masked out by n_mask) into the online softmax of the
    query vectors q: the running maximum, sum and weighted values (m_i, l_i, acc). visible [queries, BLOCK]: which
    query sees which key. A query that has seen no key yet keeps m = -inf (0 is subtracted there: its p are 0)."""
    block = tl.load(table + n // KV_BLOCK, mask=n_mask, other=0).to(tl.int64)
    k_rows = block * stride_k_block + kv_head * stride_k_head + (n % KV_BLOCK) * K_ROW
    k = _load_rows(kc_ptr, k_rows, d, n_mask, K_BITS, HEAD_DIM, BLOCK).to(q.dtype)
    s = tl.where(visible, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v_rows = block * stride_v_block + kv_head * stride_v_head + (n % KV_BLOCK) * V_ROW
    v = _load_rows(vc_ptr, v_rows, d, n_mask, V_BITS, HEAD_DIM, BLOCK).to(q.dtype)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _one_sequence_tile(seq_ptr, first, n_rows, TILE: tl.constexpr):
    """Whether rows first..first + TILE - 1 all exist and belong to one sequence."""
    r = first + tl.arange(0, TILE)
    seqs = tl.load(seq_ptr + r, mask=r < n_rows, other=-1)
    return (tl.min(seqs, axis=0) == tl.max(seqs, axis=0)) & (first + TILE <= n_rows)


@triton.jit
def _attn_tile_kernel(q_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, table_ptr, mid_o_ptr, mid_lse_ptr, n_rows, scale,
                      stride_q_tok, stride_q_head, stride_k_block, stride_k_head, stride_v_block, stride_v_head,
                      stride_t, KV_BLOCK: tl.constexpr, TILE: tl.constexpr, TILE_SPLITS: tl.constexpr,
                      N_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, N_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr,
                      K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * TILE
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if _one_sequence_tile(seq_ptr, first, n_rows, TILE):
        seq = tl.load(seq_ptr + first)
        # query vector m: row first + m // GROUP_PAD, head kv_head * GROUP + m % GROUP_PAD
        m = tl.arange(0, TILE * GROUP_PAD)
        rows = first + m // GROUP_PAD
        heads = kv_head * GROUP + m % GROUP_PAD
        m_mask = m % GROUP_PAD < GROUP
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                    mask=m_mask[:, None], other=0.0)
        pos = tl.load(pos_ptr + rows)
        last = tl.max(pos, axis=0)
        # The tile's keys 0..last cut into TILE_SPLITS splits of whole key tiles, this program's one of them (so a
        # few long tiles still spread over the GPU); the merge kernel joins a row's splits as it does the row
        # kernel's.
        split_len = tl.cdiv(last + 1, TILE_SPLITS * BLOCK) * BLOCK
        start = split * split_len
        table = table_ptr + seq * stride_t
        m_i = tl.full([TILE * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE * GROUP_PAD], tl.float32)
        acc = tl.zeros([TILE * GROUP_PAD, HEAD_DIM], tl.float32)
        n_keys = tl.minimum(split_len, tl.maximum(last + 1 - start, 0))  # (0: a split past the tile's last row)
        for i in range(0, tl.cdiv(n_keys, BLOCK)):
            n = start + i * BLOCK + tl.arange(0, BLOCK)
            m_i, l_i, acc = _attend_keys(q, n, n <= last, n[None, :] <= pos[:, None], table, kc_ptr, vc_ptr, kv_head,
                                         d, scale, m_i, l_i, acc, stride_k_block, stride_k_head, stride_v_block,
                                         stride_v_head, KV_BLOCK, HEAD_DIM, BLOCK, K_ROW, V_ROW, K_BITS, V_BITS)
        # rows that saw no key of this split: an empty entry (weight 0 in the merge)
        seen = l_i > 0
        mid = (rows * N_HEADS + heads) * N_SPLITS + split
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :],
                 tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0), mask=m_mask[:, None])
        tl.store(mid_lse_ptr + mid, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=m_mask)


@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, hid_ptr, table_ptr, mid_o_ptr, mid_lse_ptr, n_rows,
                       scale, stride_q_tok, stride_q_head, stride_k_block, stride_k_head, stride_v_block, stride_v_head,
                       stride_t, KV_BLOCK: tl.constexpr, N_SPLITS: tl.constexpr, GRID_SPLITS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr, K_BITS: tl.constexpr,
                       V_BITS: tl.constexpr, TREE: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    hidden = 0
    if TREE:  # bit j: position pos - j is another branch's (a token tree)
        hidden = tl.load(hid_ptr + row)
    tiles = tl.cdiv(pos + 1, N_SPLITS * BLOCK)  # this row's split length in key tiles
    seq = tl.load(seq_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None], other=0.0)
    table = table_ptr + seq * stride_t
    # This program takes splits first, first + GRID_SPLITS, ...: at many rows, a grid of N_SPLITS programs a row
    # would be mostly programs with nothing to read. Each split is computed alone either way (the same bits).
    n_splits = tl.cdiv(pos + 1, tiles * BLOCK)
    if TILE > 0:  # the tiled kernel has this row
        n_splits = tl.where(_one_sequence_tile(seq_ptr, row // TILE * TILE, n_rows, TILE), 0, n_splits)
    for split in range(tl.program_id(2), n_splits, GRID_SPLITS):
        start = split * tiles * BLOCK
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        # The trip counts are the row's own (read on the device), so graphs keep one launch shape for any context.
        for i in range(0, tl.minimum(tiles, tl.cdiv(pos + 1 - start, BLOCK))):
            n = start + i * BLOCK + tl.arange(0, BLOCK)
            n_mask = n <= pos
            if TREE:
                back = pos - n
                n_mask &= (back > 63) | ((hidden >> tl.minimum(tl.maximum(back, 0), 63)) & 1 == 0)
            m_i, l_i, acc = _attend_keys(q, n, n_mask, n_mask[None, :], table, kc_ptr, vc_ptr, kv_head, d, scale, m_i,
                                         l_i, acc, stride_k_block, stride_k_head, stride_v_block, stride_v_head,
                                         KV_BLOCK, HEAD_DIM, BLOCK, K_ROW, V_ROW, K_BITS, V_BITS)
        mid = (row * N_HEADS + heads) * N_SPLITS + split
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=g_mask[:, None])
        tl.store(mid_lse_ptr + mid, m_i + tl.log(l_i), mask=g_mask)


@triton.jit
def _attn_merge_kernel(mid_o_ptr, mid_lse_ptr, seq_ptr, pos_ptr, out_ptr, n_rows, N_SPLITS: tl.constexpr,
                       SPLITS_PAD: tl.constexpr, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                       TILE: tl.constexpr, TILE_SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    split_len = tl.cdiv(pos + 1, N_SPLITS * BLOCK) * BLOCK
    n_valid = pos // split_len + 1  # splits past the row's position were never written
    if TILE > 0:  # the tiled kernel wrote this row's TILE_SPLITS entries (some maybe empty)
        n_valid = tl.where(_one_sequence_tile(seq_ptr, row // TILE * TILE, n_rows, TILE), TILE_SPLITS, n_valid)
    i = tl.arange(0, SPLITS_PAD)
    valid = i < n_valid
    d = tl.arange(0, HEAD_DIM)
    base = (row * N_HEADS + head) * N_SPLITS
    # all splits in one step: no serial loop over them
    lse = tl.load(mid_lse_ptr + base + i, mask=valid, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    o = tl.load(mid_o_ptr + (base + i)[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (row * N_HEADS + head) * HEAD_DIM + d, acc.to(out_ptr.dtype.element_ty))


def splits_in_grid(programs: int, least: int | None = None) -> int:
    """Programs a (row, kv head) or (tile, kv head) gets in the grid: enough that ~`least` programs (GRID_PROGRAMS)
    share the GPU, at most MAX_SPLITS (a power of two, so the graphs' launch shapes stay few)."""
    least = GRID_PROGRAMS if least is None else least
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(-(-least // programs))))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              seq_ids: torch.Tensor, table: torch.Tensor, scale: float, hidden: torch.Tensor | None = None,
              tiled: bool = True) -> torch.Tensor:
    """q [N, H, D]; caches [n_blocks, Hkv, block_size, row] (one layer: rows of D values, or packed rows),
    table int32 [seqs, blocks a sequence] -> out [N, H, D]. hidden: int64 [N], token trees' rows (bit j hides
    position - j from the row, attention.attention_ref). tiled=False: every row through the row kernels (a
    row's bits independent of the other rows)."""
    n_rows, n_heads, head_dim = q.shape
    n_kv, block_size = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    tile_pad = triton.next_power_of_2(group)
    # rows a tile (none: row kernels only); tree steps keep them too (their rows' masks are per row)
    tile = max(1, TILE_QUERIES // tile_pad) if tiled and hidden is None and n_rows >= TILED_MIN_ROWS else 0
    n_splits = MAX_SPLITS  # the most splits a row's context is cut into
    grid_splits = splits_in_grid(n_rows * n_kv)
    for c in (k_cache, v_cache):
        assert c.stride(3) == 1 and c.stride(2) == c.shape[3]
    assert q.stride(2) == 1 and table.stride(1) == 1
    k_bits, v_bits = (format_of(c, head_dim).code_bits for c in (k_cache, v_cache))
    mid_o = torch.empty((n_rows, n_heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((n_rows, n_heads, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((n_rows, n_heads, head_dim), dtype=q.dtype, device=q.device)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               table.stride(0))
    formats = {"K_ROW": k_cache.shape[3], "V_ROW": v_cache.shape[3], "K_BITS": k_bits, "V_BITS": v_bits}
    n_tiles = triton.cdiv(n_rows, tile) if tile else 0
    tile_splits = splits_in_grid(n_tiles * n_kv, TILE_PROGRAMS) if tile else 1
    if tile:
        _attn_tile_kernel[(n_tiles, n_kv, tile_splits)](
            q, k_cache, v_cache, seq_ids, positions, table, mid_o, mid_lse, n_rows, scale, *strides,
            KV_BLOCK=block_size, TILE=tile, TILE_SPLITS=tile_splits, N_SPLITS=n_splits, GROUP=group,
            GROUP_PAD=tile_pad, N_HEADS=n_heads, HEAD_DIM=head_dim, BLOCK=BLOCK_N, **formats, num_warps=8,
            num_stages=2)
    _attn_split_kernel[(n_rows, n_kv, grid_splits)](
        q, k_cache, v_cache, seq_ids, positions, positions if hidden is None else hidden, table, mid_o, mid_lse, n_rows,
        scale, *strides, KV_BLOCK=block_size, N_SPLITS=n_splits, GRID_SPLITS=grid_splits, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), N_HEADS=n_heads, HEAD_DIM=head_dim, BLOCK=BLOCK_N,
        **formats, TREE=hidden is not None, TILE=tile, num_warps=4, num_stages=2,
    )
    _attn_merge_kernel[(n_rows, n_heads)](mid_o, mid_lse, seq_ids, positions, out, n_rows, N_SPLITS=n_splits,
                                           SPLITS_PAD=max(2, triton.next_power_of_2(n_splits)), N_HEADS=n_heads,
                                           HEAD_DIM=head_dim, BLOCK=BLOCK_N, TILE=tile, TILE_SPLITS=tile_splits,
                                           num_warps=4)
    return out
