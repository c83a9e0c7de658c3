"""The Triton kernel behind :mod:`kvlab.kernels.attention.backend_triton` (imported only where
Triton is installed). Formats are compile-time constants, so each (key format, value
format) pair is its own specialised kernel. On CPU tensors it runs in Triton's interpreter,
which ``TRITON_INTERPRET=1`` selects when Triton is first imported."""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.attention.segments import FORMATS, Segment, Stored


@triton.jit
def _rows(data, scale, zero, base, zbase, pos, z_row, d, mask,
          FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Keys or values (BLOCK_N, DP) in fp32 of the slots at ``base`` (element offsets of
    their rows) and ``zbase`` (offsets of their scale rows' block and head)."""
    if FMT == 0:  # the model dtype
        rows = tl.load(data + base[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FMT == 2 or FMT == 3:  # planar int codes: channel c in word c % W at (c // W) bits
        words: tl.constexpr = D * BITS // 32
        word = tl.load(data + base[:, None] + (d % words)[None, :], mask=mask, other=0)
        codes = (word >> ((d // words) * BITS)[None, :]) & ((1 << BITS) - 1)
        if FMT == 2:  # a scale per token and GROUP channels
            at = zbase[:, None] + pos[:, None] * z_row + (d // GROUP)[None, :]
        else:  # a scale per channel and GROUP tokens
            at = zbase[:, None] + (pos // GROUP)[:, None] * z_row + d[None, :]
        step = tl.load(scale + at, mask=mask, other=0.0).to(tl.float32)
        low = tl.load(zero + at, mask=mask, other=0.0).to(tl.float32)
        rows = codes.to(tl.float32) * step + low
    elif FMT == 6:  # a codebook: BITS-bit codes LSB first along the row, a scale a group
        at = zbase[:, None] + pos[:, None] * z_row + (d // GROUP)[None, :]
        bit = d * BITS
        first = tl.load(data + base[:, None] + (bit // 8)[None, :], mask=mask, other=0)
        spill = mask & ((bit % 8) + BITS > 8)[None, :]  # the code runs into the next byte
        second = tl.load(data + base[:, None] + (bit // 8 + 1)[None, :], mask=spill, other=0)
        word = first.to(tl.int32) | (second.to(tl.int32) << 8)
        codes = (word >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
        step = tl.load(scale + at, mask=mask, other=0.0).to(tl.float32)
        rows = tl.load(zero + codes, mask=mask, other=0.0) * step
    else:  # fp8 / fp4 through the format's value table in `zero`
        at = zbase[:, None] + pos[:, None] * z_row + (d // GROUP)[None, :]
        if FMT == 4:
            codes = tl.load(data + base[:, None] + d[None, :], mask=mask, other=0).to(tl.int32)
            step = tl.load(scale + at, mask=mask, other=0.0).to(tl.float32)
        else:  # two e2m1 codes a byte, the even channel low; a table-coded scale byte
            pair = tl.load(data + base[:, None] + (d // 2)[None, :], mask=mask, other=0)
            codes = (pair.to(tl.int32) >> ((d % 2) * 4)[None, :]) & 15
            scale_code = tl.load(scale + at, mask=mask, other=0).to(tl.int32)
            step = tl.load(zero + 16 + scale_code, mask=mask, other=0.0)
        rows = tl.load(zero + codes, mask=mask, other=0.0) * step
    return rows


@triton.jit
def _partials(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, table, lo, hi,
              maxima, sums, outs,
              k_sb, k_sh, k_ss, kz_sb, kz_sh, kz_sr, v_sb, v_sh, v_ss, vz_sb, vz_sh, vz_sr,
              table_stride, block_size, ring, capacity, n_chunks, scale,
              H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
              DP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
              K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
              V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr):  # fmt: skip
    row_head = tl.program_id(0)
    chunk = tl.program_id(1)
    b, h = row_head // H, row_head % H
    first, last = tl.load(lo + b), tl.load(hi + b)
    g, d = tl.arange(0, GP), tl.arange(0, DP)
    in_d = d < D
    query = tl.load(q + (row_head * G + g[:, None]) * D + d[None, :],
                    mask=(g < G)[:, None] & in_d[None, :], other=0.0)  # fmt: skip
    top = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, capacity)
    if ring == 0:  # slots are tokens: skip the chunk's slots outside [lo, hi)
        end = tl.minimum(end, last)
        start = tl.maximum(start, first - first % BLOCK_N)
    period = tl.maximum(ring, 1)
    for tile in range(start, end, BLOCK_N):
        slot = tile + tl.arange(0, BLOCK_N)
        inside = slot < end
        newest = last - 1
        token = tl.where(ring > 0, newest - ((newest - slot) % period + period) % period, slot)
        visible = inside & (token >= first) & (token < last)
        block = tl.load(table + b * table_stride + slot // block_size, mask=inside, other=0)
        pos = slot % block_size
        mask = visible[:, None] & in_d[None, :]
        k_at, kz_at = block * k_sb + h * k_sh + pos * k_ss, block * kz_sb + h * kz_sh
        keys = _rows(k_data, k_scale, k_zero, k_at, kz_at, pos, kz_sr, d, mask,
                     K_FMT, K_BITS, K_GROUP, D)  # fmt: skip
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale  # (GP, N)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        probs = tl.exp(scores - safe[:, None])
        decay = tl.exp(top - safe)
        v_at, vz_at = block * v_sb + h * v_sh + pos * v_ss, block * vz_sb + h * vz_sh
        values = _rows(v_data, v_scale, v_zero, v_at, vz_at, pos, vz_sr, d, mask,
                       V_FMT, V_BITS, V_GROUP, D)  # fmt: skip
        acc = acc * decay[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        total = total * decay + tl.sum(probs, axis=1)
        top = new_top
    at = (row_head * n_chunks + chunk) * G + g
    tl.store(maxima + at, top, mask=g < G)
    tl.store(sums + at, total, mask=g < G)
    tl.store(outs + at[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & in_d[None, :])


def _operands(st: Stored) -> tuple:
    """Data, scale and zero tensors (data stands in for absent ones) and their strides."""
    scale = st.data if st.scale is None else st.scale
    zero = st.data if st.zero is None else st.zero
    z_strides = (0, 0, 0) if st.scale is None else st.scale.stride()[:3]
    return (st.data, scale, zero), (*st.data.stride()[:3], *z_strides)


def decode_partials(s: Segment, scale: float, maxima, sums, outs, chunk: int, block_n: int):
    """Fill ``maxima``, ``sums`` (B * H, chunks, G) and ``outs`` (B * H, chunks, G, D)."""
    batch, heads, group, dim = s.q.shape
    (k_tensors, k_strides), (v_tensors, v_strides) = _operands(s.keys), _operands(s.values)
    grid = (batch * heads, maxima.shape[1])
    _partials[grid](
        s.q.float().contiguous(), *k_tensors, *v_tensors, s.table, s.lo, s.hi,
        maxima, sums, outs, *k_strides, *v_strides,
        s.table.stride(0), s.block_size, s.ring, s.capacity, maxima.shape[1], scale,
        H=heads, G=group, D=dim, GP=triton.next_power_of_2(group),
        DP=triton.next_power_of_2(dim), CHUNK=chunk, BLOCK_N=block_n,
        K_FMT=FORMATS[s.keys.format], K_BITS=s.keys.bits, K_GROUP=max(s.keys.group, 1),
        V_FMT=FORMATS[s.values.format], V_BITS=s.values.bits,
        V_GROUP=max(s.values.group, 1),
    )  # fmt: skip
