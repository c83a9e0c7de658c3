"""``int8`` / ``int4`` / ``int2``: quantized KV cache after KIVI (Liu et al., arXiv 2402.02750).

Keys are quantized per channel (a group of G tokens shares a scale and zero per channel) or
per token as Hugging Face's QuantizedCache does; values per token (groups of G channels).
Row b keeps its tokens [0, nq) as codes, nq = max(0, (length - residual) // G) * G, and the
rest exactly in a ring of ``residual + G`` slots (position p at slot p % ring), so a group
is quantized once all its tokens are known and the ``residual`` most recent stay exact.
Decode reads the codes in place (scales folded per row in the decode kernel, never a
dequantized history) plus the exact ring; multi-token steps dequantize and run SDPA (they
are compute-bound). A step's own new tokens are exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvlab.cache.base import (
    CacheOptions,
    KVCache,
    RowState,
    Step,
    StepInfo,
    nbytes,
    register,
    rows_of,
    sdpa,
)
from kvlab.cache.masks import visible
from kvlab.cache.rows import decode_output, grouped, write_rows
from kvlab.kernels import Segment, Stored, decode_attention
from kvlab.kernels.int_codes import BITS, KEY_AXES, ChannelCodes, TokenCodes, words_per_row


@dataclass
class QuantizedOptions(CacheOptions):
    bits: int = 4
    group_size: int = 32
    residual: int = 128
    key_axis: str = "channel"

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"cache.options.bits={self.bits} is invalid; allowed: {BITS}")
        if self.group_size < 1:
            raise ValueError(f"cache.options.group_size={self.group_size} must be >= 1")
        if self.residual < 0:
            raise ValueError(f"cache.options.residual={self.residual} must be >= 0")
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"cache.options.key_axis={self.key_axis!r}; allowed: {KEY_AXES}")


@dataclass
class KiviStep(Step):
    """``nq``/``nq_after`` (B,): tokens held as codes before / after the step; ``groups``
    (B, M): the group indices this step quantizes (the trash group where a row has fewer
    than M); ``sources`` (B, M * G): their tokens' positions; ``ring_slots`` (B, T): ring
    slot of each new token (trash: padding, or quantized within the step); ``mask`` over
    [codes | ring | new] for multi-token steps; ``read``: code slots those read."""

    nq: torch.Tensor
    nq_after: torch.Tensor
    groups: torch.Tensor
    sources: torch.Tensor
    ring_slots: torch.Tensor
    rows: torch.Tensor
    origin: torch.Tensor
    mask: torch.Tensor | None = None
    read: int = 0
    quantizes: bool = True


class QuantizedCache(KVCache):
    """Per layer: key and value codes (B, H_kv, S, W) int32 with their scales and zeros,
    and an exact ring (B, H_kv, residual + G + 1, D) of keys and values (+1: trash)."""

    Options = QuantizedOptions

    @classmethod
    def describe(cls, options: QuantizedOptions) -> str:
        return (
            f"KIVI int{options.bits}: keys per {options.key_axis}, values per token, "
            f"{options.residual} recent tokens exact"
        )

    # ---- layout ------------------------------------------------------------------------
    @classmethod
    def _layout(cls, spec, options, batch_size: int, max_tokens: int) -> dict[str, tuple]:
        """name -> (shape, dtype) of one layer's tensors."""
        o, dim, lead = options, spec.head_dim, (batch_size, spec.num_kv_heads)
        group = o.group_size
        slots = -(-max_tokens // group) * group + group  # + one trash group
        words = words_per_row(dim, o.bits)
        if dim % group:  # value groups (and per-token key groups) span channels
            raise ValueError(f"cache.options.group_size={group} must divide head_dim={dim}")
        key_rows = (slots // group, dim) if o.key_axis == "channel" else (slots, dim // group)
        return {
            "key_codes": ((*lead, slots, words), torch.int32),
            "key_scale": ((*lead, *key_rows), spec.dtype),
            "key_zero": ((*lead, *key_rows), spec.dtype),
            "value_codes": ((*lead, slots, words), torch.int32),
            "value_scale": ((*lead, slots, dim // group), spec.dtype),
            "value_zero": ((*lead, slots, dim // group), spec.dtype),
            "ring": ((2, *lead, o.residual + group + 1, dim), spec.dtype),
        }

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        layout = cls._layout(spec, options, batch_size, max_tokens)
        per_layer = {name: nbytes(*shape_dtype) for name, shape_dtype in layout.items()}
        codes = sum(v for k, v in per_layer.items() if k != "ring")
        return {"codes": spec.num_layers * codes, "ring": spec.num_layers * per_layer["ring"]}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s, o = self.spec, self.options
        layout = self._layout(s, o, batch_size, max_tokens)
        self.store = {
            name: [torch.zeros(shape, dtype=dtype, device=s.device) for _ in range(s.num_layers)]
            for name, (shape, dtype) in layout.items()
        }
        self.ring_size = o.residual + o.group_size
        self.trash_group = layout["key_codes"][0][2] // o.group_size - 1
        group, bits = o.group_size, o.bits
        self.key_codec = (
            ChannelCodes(bits, group) if o.key_axis == "channel" else TokenCodes(bits, group)
        )
        self.value_codec = TokenCodes(bits, group)

    def row_state(self) -> list[RowState]:
        rows = [rows_of(layers, 1 if name == "ring" else 0) for name, layers in self.store.items()]
        return [*super().row_state(), *(entry for entries in rows for entry in entries)]

    # ---- planning a step ---------------------------------------------------------------
    def quantized_tokens(self, length: torch.Tensor) -> torch.Tensor:
        """Tokens held as codes for a row of ``length`` tokens (a multiple of G)."""
        group = self.options.group_size
        return (length - self.options.residual).clamp(min=0) // group * group

    def plan(self, info: StepInfo) -> KiviStep:
        start, end = self._row_bounds(info)
        group, ring, device = self.options.group_size, self.ring_size, start.device
        if max(self.lengths) + info.steps > self.trash_group * group:
            raise ValueError(
                f"a step of {info.steps} tokens after {max(self.lengths)} stored exceeds the "
                f"{self.trash_group * group} slots allocated"
            )
        nq, nq_after = self.quantized_tokens(start), self.quantized_tokens(end)
        count = self._groups_closing(info)
        first = nq // group  # (B,)
        index = torch.arange(count, device=device)  # (M,)
        groups = torch.where(
            index[None] < ((nq_after - nq) // group)[:, None],
            first[:, None] + index,
            self.trash_group,
        )  # (B, M)
        sources = nq[:, None] + torch.arange(count * group, device=device)[None]  # (B, M*G)
        positions = start[:, None] + torch.arange(info.steps, device=device)  # (B, T)
        in_ring = (positions < end[:, None]) & (positions >= nq_after[:, None])
        ring_slots = torch.where(in_ring, positions % ring, ring)  # trash: slot `ring`
        rows = torch.arange(len(self.lengths), device=device)[:, None]
        step = KiviStep(
            info, start, end, nq, nq_after, groups, sources, ring_slots, rows, torch.zeros_like(nq)
        )
        step.quantizes = self.static or self._any_group_closes(info)
        if info.steps > 1:
            step.read = self._host_quantized(max(self.lengths))
            step.mask = self._prefill_mask(step)
        return step

    def _host_quantized(self, length: int) -> int:
        """:meth:`quantized_tokens` of a host length."""
        group = self.options.group_size
        return max(0, length - self.options.residual) // group * group

    def _groups_closing(self, info: StepInfo) -> int:
        """M: groups a row can close in this step, ceil(T / G) (1 in decode: static)."""
        return -(-info.steps // self.options.group_size)

    def _any_group_closes(self, info: StepInfo) -> bool:
        """Host check: does some row quantize a group (lengths are host state)?"""
        pairs = zip(self.lengths, info.num_new, strict=True)
        return any(self._host_quantized(n + k) > self._host_quantized(n) for n, k in pairs)

    def _prefill_mask(self, step: KiviStep) -> torch.Tensor:
        """(B, 1, T, read + ring + 1 + T) over [codes | ring | new] by the positions held."""
        device = step.start.device
        codes = torch.arange(step.read, device=device)
        codes = torch.where(codes[None] < step.nq[:, None], codes[None], -1)  # (B, read)
        slots = torch.arange(self.ring_size + 1, device=device)
        top = step.start[:, None] - 1
        held = top - (top - slots[None]) % self.ring_size  # newest position at each slot
        held = torch.where((held >= step.nq[:, None]) & (slots[None] < self.ring_size), held, -1)
        positions = step.start[:, None] + torch.arange(step.info.steps, device=device)
        return visible(positions, torch.cat([codes, held, positions], dim=1))

    # ---- one layer -------------------------------------------------------------------
    def attend(self, step, layer, q, k, v, k_raw):
        if step.decode:
            self._write_ring(step, layer, k, v)
            segments = self._segments(step, layer, q)
            out = decode_attention(segments, q.shape[-1] ** -0.5, q.dtype)
            self._quantize_closed(step, layer, None, None)
            return decode_output(out, q)
        keys, values = self._context(step, layer, k, v)
        out = sdpa(q, keys, values, mask=step.mask)
        self._quantize_closed(step, layer, k, v)
        self._write_ring(step, layer, k, v)
        return out

    def _segments(self, step: KiviStep, layer: int, q: torch.Tensor) -> list[Segment]:
        st, o = self.store, self.options
        queries = grouped(q, self.spec.num_kv_heads)
        key_format = "channel_codes" if o.key_axis == "channel" else "token_codes"
        keys = Stored(st["key_codes"][layer], key_format, o.bits, o.group_size,
                      st["key_scale"][layer], st["key_zero"][layer])  # fmt: skip
        values = Stored(st["value_codes"][layer], "token_codes", o.bits, o.group_size,
                        st["value_scale"][layer], st["value_zero"][layer])  # fmt: skip
        ring = st["ring"][layer]
        exact = Segment(queries, Stored(ring[0]), Stored(ring[1]), step.rows, step.nq,
                        step.end, ring=self.ring_size)  # fmt: skip
        return [Segment(queries, keys, values, step.rows, step.origin, step.nq), exact]

    def _context(self, step: KiviStep, layer: int, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """[codes dequantized | ring | new] (B, H_kv, L, D) for a multi-token step."""
        st, read, dtype = self.store, step.read, self.spec.dtype
        keys = self.key_codec.decode(
            *(
                st[n][layer][:, :, : self._rows(n, read)]
                for n in ("key_codes", "key_scale", "key_zero")
            ),
            dtype=dtype,
        )
        values = self.value_codec.decode(
            *(st[n][layer][:, :, :read] for n in ("value_codes", "value_scale", "value_zero")),
            dtype=dtype,
        )
        ring = st["ring"][layer]
        return torch.cat([keys, ring[0], k], dim=2), torch.cat([values, ring[1], v], dim=2)

    def _rows(self, name: str, tokens: int) -> int:
        """Rows of store ``name`` covering the first ``tokens`` token slots."""
        per_group = name in ("key_scale", "key_zero") and self.options.key_axis == "channel"
        return tokens // self.options.group_size if per_group else tokens

    def _write_ring(self, step: KiviStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ring = self.store["ring"][layer]
        write_rows(ring[0], step.ring_slots, k)
        write_rows(ring[1], step.ring_slots, v)

    def _quantize_closed(
        self, step: KiviStep, layer: int, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> None:
        """Quantize the groups this step closes from the ring (tokens before the step) and
        the new k/v (B, H_kv, T, D); in decode the new token is already in the ring. A row
        that closes no group writes into the trash group."""
        if not step.quantizes:
            return
        ring = self.store["ring"][layer]
        keys, values = self._gather(step, ring[0], k), self._gather(step, ring[1], v)  # (B,H,M*G,D)
        group = self.options.group_size
        token_slots = step.groups[:, :, None] * group + torch.arange(group, device=keys.device)
        token_slots = token_slots.flatten(1)  # (B, M * G)
        key_rows = step.groups if self.options.key_axis == "channel" else token_slots
        self._put("key", layer, self.key_codec.encode(keys), token_slots, key_rows)
        self._put("value", layer, self.value_codec.encode(values), token_slots, token_slots)

    def _gather(self, step: KiviStep, ring: torch.Tensor, new: torch.Tensor | None) -> torch.Tensor:
        """Rows at positions ``step.sources`` (B, N): from the ring, or from ``new`` for
        positions the step itself brings."""
        batch, heads, _, dim = ring.shape
        index = (step.sources % self.ring_size)[:, None, :, None].expand(batch, heads, -1, dim)
        rows = ring.gather(2, index)
        if new is None:
            return rows
        offset = (step.sources - step.start[:, None]).clamp(0, new.shape[2] - 1)
        fresh = new.gather(2, offset[:, None, :, None].expand(batch, heads, -1, dim))
        brought = (step.sources >= step.start[:, None])[:, None, :, None]
        return torch.where(brought, fresh, rows)

    def _put(self, kind: str, layer: int, encoded, token_slots, scale_rows) -> None:
        words, scale, zero = encoded
        write_rows(self.store[f"{kind}_codes"][layer], token_slots, words)
        write_rows(self.store[f"{kind}_scale"][layer], scale_rows, scale)
        write_rows(self.store[f"{kind}_zero"][layer], scale_rows, zero)

    # ---- accounting ----------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        if not self.lengths:
            return []
        return [t for layers in self.store.values() for t in layers]

    def used_bytes(self) -> int:
        """Bytes holding tokens: the codes of quantized tokens and the exact tokens in the
        ring (per-slot shares of each tensor)."""
        if not self.lengths:
            return 0
        quantized = [self._host_quantized(n) for n in self.lengths]
        exact = [n - q for n, q in zip(self.lengths, quantized, strict=True)]
        used = 0
        for name, layers in self.store.items():
            t = layers[0]
            slot_axis = 3 if name == "ring" else 2
            per_slot = t.numel() * t.element_size() // (len(self.lengths) * t.shape[slot_axis])
            held = sum(exact) if name == "ring" else sum(self._rows(name, n) for n in quantized)
            used += per_slot * held * len(layers)
        return used


@dataclass
class PresetOptions(QuantizedOptions):
    """A preset's options: its width is the preset's (``cache=int4 cache.options.bits=8``
    is refused, never run as another width under the int4 name)."""

    def __post_init__(self) -> None:
        preset = type(self).__dataclass_fields__["bits"].default
        if self.bits != preset:
            raise ValueError(
                f"cache.options.bits={self.bits} contradicts cache=int{preset}; allowed: "
                f"{preset} (cache=int8, int4 or int2 picks the width)"
            )
        super().__post_init__()


@register("int8")
class Int8Cache(QuantizedCache):
    """KIVI with 8-bit codes."""

    @dataclass
    class Options(PresetOptions):
        bits: int = 8


@register("int4")
class Int4Cache(QuantizedCache):
    """KIVI with 4-bit codes, eight per 32-bit word."""

    @dataclass
    class Options(PresetOptions):
        bits: int = 4


@register("int2")
class Int2Cache(QuantizedCache):
    """KIVI with 2-bit codes, sixteen per 32-bit word."""

    @dataclass
    class Options(PresetOptions):
        bits: int = 2
