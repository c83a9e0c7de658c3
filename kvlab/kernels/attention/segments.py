"""What decode attention reads: queries over K/V *segments* as caches store them (a full
cache; a quantized history plus an exact ring; sink and window slots seen by differently
rotated queries), each addressed through a block table, and :func:`reference_attention`,
the torch computation every backend is tested against (dequantize what is visible, masked
softmax)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.kernels.codes.int_codes import ChannelCodes, TokenCodes

# the C kernels' format numbers (attention_job.h's FMT_*; fp: 0 or 1 by dtype)
FORMATS = {"fp": 0, "token_codes": 2, "channel_codes": 3, "fp8": 4, "fp4": 5, "codebook": 6}
TABLES = {"fp8": 256, "fp4": 16 + 256}  # formats read through a fixed value table in ``zero``
TABLE_FORMATS = (*TABLES, "codebook")  # ``zero`` holds values, not one row's zeros


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., E) holding two 4-bit codes each, the even channel in the low nibble, as
    the codes (..., 2E)."""
    return unpack_bits(packed, 4)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., D) of ``bits`` bits each (1 to 8) as bytes (..., D * bits / 8), LSB first
    along the row: code d at bit d * bits (4 bits: two a byte, the even channel low)."""
    shape, width = codes.shape, codes.shape[-1] * bits
    shifts = torch.arange(bits, device=codes.device)
    stream = (codes.long()[..., None] >> shifts) & 1  # (..., D, bits): the row's bits in order
    stream = stream.reshape(*shape[:-1], width // 8, 8)
    weights = 1 << torch.arange(8, device=codes.device)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits`' bytes (..., E) back as the codes (..., 8E / bits), int64."""
    stream = (packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1
    stream = stream.flatten(-2).unflatten(-1, (-1, bits))  # (..., D, bits)
    return (stream << torch.arange(bits, device=packed.device)).sum(-1)


@dataclass
class Stored:
    """K or V rows as held: ``data`` (N, H_kv, slots, E) — E = D floats for ``fp``, or
    D * bits / 32 int32 words of codes — with ``scale``/``zero`` (N, H_kv, rows, S) for
    codes: rows = slots and S = D / group (``token_codes``), or rows = slots / group and
    S = D (``channel_codes``). ``fp8``: uint8 bytes of an 8-bit float format (E = D), a
    scale per token and ``group`` channels, as ``zero`` the format's 256 values (fp32), and
    as ``bits`` its exponent bits (4: e4m3, 5: e5m2; the C kernel converts through fp16).
    ``fp4``: e2m1 codes two a byte, the even channel in the low nibble (E = D / 2), a scale
    byte per token and ``group`` channels (uint8), and as ``zero`` the 16 e2m1 values then
    the scale byte's 256 values (fp32). ``codebook``: codes of ``bits`` (1 to 4) bits
    packed LSB first along the row (:func:`pack_bits`, E = D * bits / 8 bytes), indexing
    the 2^bits values in ``zero`` (fp32), times a scale per token and ``group`` channels
    (fp32 or bf16).
    Only the last axis needs to be contiguous."""

    data: torch.Tensor
    format: str = "fp"
    bits: int = 0
    group: int = 0
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def per_head(self) -> Stored:
        """(N, H_kv, ...) storage as (N * H_kv, 1, ...) views (see :meth:`Segment.per_head`)."""

        def split(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(-1, 1, *t.shape[2:])

        table = self.format in TABLE_FORMATS  # zero is the format's values, not per row
        return Stored(
            split(self.data), self.format, self.bits, self.group, split(self.scale),
            self.zero if table else split(self.zero),
        )  # fmt: skip

    def rows(self, block_ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Decoded fp32 rows of blocks ``block_ids`` (B, n): (B, H_kv, n * slots, D)."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[block_ids].transpose(1, 2).flatten(2, 3)  # (B, H, n * rows, E)

        if self.format == "fp":
            return take(self.data).float()
        if self.format == "fp8":
            values = self.zero[take(self.data).long()]  # (B, H, L, D) through the table
            scale = take(self.scale).float().repeat_interleave(self.group, dim=-1)
            return values * scale
        if self.format == "fp4":
            codes = unpack_nibbles(take(self.data).long())  # (B, H, L, D)
            scale = self.zero[16 + take(self.scale).long()]
            return self.zero[codes] * scale.repeat_interleave(self.group, dim=-1)
        if self.format == "codebook":
            codes = unpack_bits(take(self.data), self.bits)  # (B, H, L, D)
            scale = take(self.scale).float().repeat_interleave(self.group, dim=-1)
            return self.zero[codes] * scale
        words, scale, zero = take(self.data), take(self.scale), take(self.zero)
        codec = (TokenCodes if self.format == "token_codes" else ChannelCodes)(
            self.bits, self.group
        )
        return codec.decode(words, scale, zero)


@dataclass
class Segment:
    """Queries ``q`` (B, H_kv, G, D) of each KV group over logical tokens lo[b] <= t <
    hi[b] of row b, stored at slot t % ring (``ring`` > 0) or t, in block
    ``table[b, slot // block_size]`` at position ``slot % block_size``."""

    q: torch.Tensor
    keys: Stored
    values: Stored
    table: torch.Tensor  # (B, blocks) int64
    lo: torch.Tensor  # (B,) int64
    hi: torch.Tensor  # (B,) int64
    ring: int = 0

    @property
    def block_size(self) -> int:
        return self.keys.data.shape[2]

    @property
    def capacity(self) -> int:
        """Logical tokens a row can address."""
        return self.ring or self.table.shape[1] * self.block_size

    def per_token(self, start: torch.Tensor, steps: int) -> Segment:
        """The segment of B rows for a step of ``steps`` query tokens a row, its queries
        ``q`` already (B * steps, H_kv, G, D): row b * steps + t is token t of row b, which
        sees the row's tokens before start[b] + t + 1 (causal within the step; bounds
        clamped, so a token before the segment's range sees none of it)."""
        token_end = start[:, None] + 1 + torch.arange(steps, device=start.device)  # (B, T)
        hi = torch.minimum(self.hi[:, None], token_end).flatten()
        lo = torch.minimum(self.lo.repeat_interleave(steps), hi)
        table = self.table.repeat_interleave(steps, dim=0)
        return Segment(self.q, self.keys, self.values, table, lo, hi, self.ring)

    def per_head(self, index: tuple | None = None) -> Segment:
        """The same attention with every (row, KV head) as a row of one KV head, so each
        head can have a table of its own (a top-k of entries per head): queries
        (B * H_kv, 1, G, D), storage seen as (N * H_kv, 1, slots, E) — a view, so block and
        head axes must merge — and block ``n`` of row ``b`` as block ``n * H_kv + h`` of
        row ``b * H_kv + h``. ``index``: :meth:`per_head_index`, when already built (it
        depends only on the table and bounds, which every layer of a step shares)."""
        batch, heads = self.q.shape[:2]
        table, lo, hi = index or self.per_head_index()
        return Segment(
            self.q.reshape(batch * heads, 1, *self.q.shape[2:]),
            self.keys.per_head(),
            self.values.per_head(),
            table,
            lo,
            hi,
            self.ring,
        )

    def per_head_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Table, lo and hi of :meth:`per_head`'s rows."""
        return per_head_index(self.table, self.lo, self.hi, self.q.shape[1])


def per_head_index(table, lo, hi, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`Segment.per_head`'s table, lo and hi for a segment of ``heads`` KV heads over
    ``table`` (B, blocks) and bounds ``lo``, ``hi`` (B,) (a step's policy builds it once for
    all its layers)."""
    head = torch.arange(heads, device=table.device)
    table = (table[:, None, :] * heads + head[None, :, None]).flatten(0, 1)
    return table, lo.repeat_interleave(heads), hi.repeat_interleave(heads)


def reference_attention(
    segments: list[Segment], scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The same attention with torch ops, in fp32: every addressable token of each segment
    decoded, invisible ones masked; ``sinks`` (B, H_kv, G), where given, one more column of
    the softmax, of value 0. (B, H_kv, G, D)."""
    scores, values = [], []
    for s in segments:
        slots = torch.arange(s.capacity, device=s.q.device)  # logical token index t
        blocks = s.table[:, : -(-s.capacity // s.block_size)]  # (B, n)
        dim = s.q.shape[-1]
        keys = s.keys.rows(blocks, dim)[:, :, : s.capacity]  # (B, H, L, D) in slot order
        vals = s.values.rows(blocks, dim)[:, :, : s.capacity]
        held = _logical_tokens(s, slots)  # (B, L): logical token in each slot
        visible = (held >= s.lo[:, None]) & (held < s.hi[:, None])  # (B, L)
        logits = (s.q.float() @ keys.transpose(-1, -2)) * scale  # (B, H, G, L)
        scores.append(logits.masked_fill(~visible[:, None, None], float("-inf")))
        values.append(vals)
    if sinks is not None:
        scores.append(sinks[..., None].float())
    probs = torch.cat(scores, dim=-1).softmax(dim=-1).nan_to_num(0.0)
    out, start = 0.0, 0
    for vals in values:
        out = out + probs[..., start : start + vals.shape[2]] @ vals
        start += vals.shape[2]
    return out


def _logical_tokens(s: Segment, slots: torch.Tensor) -> torch.Tensor:
    """(B, L) the logical token each slot holds for a window lo..hi: the t with t % ring
    == slot in hi - ring <= t < hi (ring), or the slot itself."""
    if not s.ring:
        return slots.expand(s.lo.shape[0], -1)
    top = s.hi[:, None] - 1  # (B, 1): the newest token
    return top - (top - slots) % s.ring


def merge_partials(maxima, sums, outs) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial softmax results along axis 1 — maxima and sums (R, C, G), unnormalised
    outputs (R, C, G, D) — as one output (R, G, D) and its log-sum-exp (R, G). Rows that
    see no token get output 0 and log-sum-exp -inf."""
    top = maxima.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(maxima - top)  # a chunk that saw nothing: exp(-inf) = 0
    total = (sums * weight).sum(dim=1)
    out = (outs * weight[..., None]).sum(dim=1) / total.clamp_min(1e-30)[..., None]
    return out, top[:, 0] + torch.log(total)


def merge_segments(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Outputs (..., D) with their log-sum-exps (...) of disjoint key sets as the attention
    over all of them (one softmax)."""
    if len(parts) == 1:
        return parts[0][0]
    outs = torch.stack([out for out, _ in parts], dim=1)  # (R, S, D), rows flattened
    lses = torch.stack([lse for _, lse in parts], dim=1)
    shape = parts[0][0].shape
    outs, lses = outs.flatten(2, -2), lses.flatten(2)
    out, _ = merge_partials(lses, torch.ones_like(lses), outs)
    return out.view(shape)
