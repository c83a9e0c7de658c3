"""``int8`` / ``int4`` / ``int2``: quantized KV cache after KIVI (Liu et al., arXiv 2402.02750).

Keys are quantized per channel (a group of G tokens shares a scale and zero per channel) or
per token as Hugging Face's QuantizedCache does; values per token (groups of G channels).
The most recent ``residual`` tokens stay in full precision and are quantized a group at a
time as they fill. Attention dequantizes what is kept; a step's own new tokens are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import CacheOptions, KVCache, StepInfo, register, sdpa
from kvlab.cache.codec import BITS, dequantize, quantize

KEY_AXES = ("channel", "token")


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


class TokenGroupStore:
    """Quantized rows of tokens, grouped over channels: codes (L, B, H, S, D/G, G*b/8)."""

    def __init__(self, layers, batch, heads, slots, dim, group, bits, dtype, device):
        if dim % group:
            raise ValueError(f"cache.options.group_size={group} must divide head_dim={dim}")
        self.group, self.bits = group, bits
        lead = (layers, batch, heads, slots, dim // group)
        self._allocate(lead, (group * bits // 8,), (1,), dtype, device)

    def _allocate(self, lead, codes_tail, scale_tail, dtype, device) -> None:
        self.codes = torch.zeros(*lead, *codes_tail, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(*lead, *scale_tail, dtype=dtype, device=device)
        self.zero = torch.zeros(*lead, *scale_tail, dtype=dtype, device=device)

    def _put(self, layer: int, row: int, lo: int, hi: int, encoded: tuple) -> None:
        """Store (codes, scale, zero) at slots lo..hi of ``row``."""
        for store, value in zip(self.tensors(), encoded, strict=True):
            store[layer, row, :, lo:hi] = value

    def _dequantize_into(self, layer: int, slots: int, target: torch.Tensor) -> None:
        """Dequantize the first ``slots`` slots of every row of ``layer`` into ``target``."""
        codes, scale, zero = (t[layer, :, :, :slots] for t in self.tensors())
        dequantize(codes, scale, zero, self.bits, out=target)

    def write(self, layer: int, row: int, start: int, x: torch.Tensor) -> None:
        """Quantize x (H, n, D) into token slots start..start+n of ``row``."""
        heads, n, _ = x.shape
        encoded = quantize(x.reshape(heads, n, -1, self.group), self.bits)
        self._put(layer, row, start, start + n, encoded)

    def read(self, layer: int, count: int, out: torch.Tensor) -> None:
        """Dequantize the first ``count`` tokens of every row into out (B, H, count, D)."""
        batch, heads, _, dim = out.shape
        target = out.view(batch, heads, count, dim // self.group, self.group)
        self._dequantize_into(layer, count, target)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]


class ChannelGroupStore(TokenGroupStore):
    """Groups of G tokens sharing a scale per channel, stored token-major and packed along
    channels: codes (L, B, H, S/G, G, D*b/8), scale and zero (L, B, H, S/G, 1, D)."""

    def __init__(self, layers, batch, heads, slots, dim, group, bits, dtype, device):
        self.group, self.bits = group, bits
        lead = (layers, batch, heads, slots // group)
        self._allocate(lead, (group, dim * bits // 8), (1, dim), dtype, device)

    def write(self, layer: int, row: int, start: int, x: torch.Tensor) -> None:
        heads, n, dim = x.shape  # n and start are multiples of the group size
        grouped = x.reshape(heads, n // self.group, self.group, dim)  # (H, n/G, G, D)
        encoded = quantize(grouped, self.bits, group_dim=-2)  # over the G tokens
        self._put(layer, row, start // self.group, (start + n) // self.group, encoded)

    def read(self, layer: int, count: int, out: torch.Tensor) -> None:
        batch, heads, _, dim = out.shape
        groups = count // self.group
        target = out.view(batch, heads, groups, self.group, dim)  # (B, H, n/G, G, D)
        self._dequantize_into(layer, groups, target)


class QuantizedCache(KVCache):
    """KIVI storage: quantized groups + a full-precision tail of recent tokens per row."""

    Options = QuantizedOptions

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.quantized: list[int] = []  # tokens per row in the quantized stores
        self.tail_len: list[int] = []  # tokens per row in the full-precision tail
        self._plan: list[int] = []

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s, o = self.spec, self.options
        slots = -(-max_tokens // o.group_size) * o.group_size
        args = (
            s.num_layers,
            batch_size,
            s.num_kv_heads,
            slots,
            s.head_dim,
            o.group_size,
            o.bits,
            s.dtype,
            s.device,
        )
        key_store = ChannelGroupStore if o.key_axis == "channel" else TokenGroupStore
        self.keys, self.values = key_store(*args), TokenGroupStore(*args)
        tail_shape = (
            s.num_layers,
            2,
            batch_size,
            s.num_kv_heads,
            o.residual + o.group_size,
            s.head_dim,
        )
        self.tail = torch.zeros(tail_shape, dtype=s.dtype, device=s.device)
        # one layer's dequantized keys and values, reused by every layer: attention reads
        # [dequantized | tail | new] from here without concatenating
        work_shape = (2, batch_size, s.num_kv_heads, slots + tail_shape[4], s.head_dim)
        self.workspace = torch.zeros(work_shape, dtype=s.dtype, device=s.device)
        self.quantized, self.tail_len = [0] * batch_size, [0] * batch_size

    def free(self, rows: Sequence[int]) -> None:
        index = self._keep_index(rows)
        keep = index.tolist()
        super().free(rows)
        for store in (self.keys, self.values):
            store.codes, store.scale, store.zero = (
                t.index_select(1, index) for t in store.tensors()
            )
        self.tail = self.tail.index_select(2, index)
        self.workspace = self.workspace.index_select(1, index)
        self.quantized = [self.quantized[b] for b in keep]
        self.tail_len = [self.tail_len[b] for b in keep]

    def begin(self, step: StepInfo) -> None:
        super().begin(step)
        o = self.options
        combined = [t + n for t, n in zip(self.tail_len, step.num_new, strict=True)]
        self._plan = [max(0, (c - o.residual) // o.group_size) * o.group_size for c in combined]
        self._mask = self._step_mask(step.positions.shape[1])

    def _step_mask(self, steps: int) -> torch.Tensor | None:
        """(B, 1, T, L) over [dequantized | tail | new]; None when nothing needs masking
        (one query per row at equal lengths, or a first prefill: plain causal attention)."""
        nq, nt = max(self.quantized), max(self.tail_len)
        uniform = len(set(self.quantized)) == 1 and len(set(self.tail_len)) == 1
        if uniform and (steps == 1 or nq + nt == 0):
            return None
        device = self.spec.device
        slots_q, slots_t = torch.arange(nq, device=device), torch.arange(nt, device=device)
        past = torch.cat(
            [
                slots_q[None] < torch.tensor(self.quantized, device=device)[:, None],
                slots_t[None] < torch.tensor(self.tail_len, device=device)[:, None],
            ],
            dim=1,
        )  # (B, nq + nt)
        causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()  # (T, T)
        batch = len(self.lengths)
        mask = torch.cat(
            [past[:, None].expand(batch, steps, -1), causal.expand(batch, steps, steps)], dim=-1
        )  # (B, T, L)
        return mask[:, None]

    def attend(self, layer, q, k, v, k_raw):
        nq, nt, steps = max(self.quantized), max(self.tail_len), q.shape[2]
        if nq + nt == 0:  # nothing kept yet: the step attends to itself only
            out = sdpa(q, k, v, mask=self._mask, causal=self._mask is None and steps > 1)
        else:
            work = self.workspace[:, :, :, : nq + nt + steps]  # (2, B, H_kv, L, D)
            if nq:
                self.keys.read(layer, nq, work[0, :, :, :nq])
                self.values.read(layer, nq, work[1, :, :, :nq])
            work[:, :, :, nq : nq + nt] = self.tail[layer, :, :, :, :nt]
            work[0, :, :, nq + nt :], work[1, :, :, nq + nt :] = k, v
            out = sdpa(q, work[0], work[1], mask=self._mask)
        self._keep(layer, k, v)
        return out

    def _keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the step to each row's tail; quantize the groups that overflowed it."""
        assert self.step is not None
        for row, (n, to_quantize) in enumerate(zip(self.step.num_new, self._plan, strict=True)):
            tail, start = self.tail[layer, :, row], self.tail_len[row]  # (2, H, R+G, D)
            if not to_quantize:
                tail[0, :, start : start + n], tail[1, :, start : start + n] = (
                    k[row, :, :n],
                    v[row, :, :n],
                )
                continue
            both = torch.cat([tail[:, :, :start], torch.stack([k[row], v[row]])[:, :, :n]], dim=2)
            self.keys.write(layer, row, self.quantized[row], both[0, :, :to_quantize])
            self.values.write(layer, row, self.quantized[row], both[1, :, :to_quantize])
            rest = both.shape[2] - to_quantize
            tail[:, :, :rest] = both[:, :, to_quantize:]

    def end(self) -> None:
        assert self.step is not None
        for row, (n, moved) in enumerate(zip(self.step.num_new, self._plan, strict=True)):
            self.quantized[row] += moved
            self.tail_len[row] += n - moved
        super().end()

    def tensors(self) -> Iterable[torch.Tensor]:
        if not self.quantized:
            return []
        return [*self.keys.tensors(), *self.values.tensors(), self.tail, self.workspace]

    def used_bytes(self) -> int:
        if not self.quantized:
            return 0
        used = 0
        for store in (self.keys, self.values):
            for t in store.tensors():  # token or group slots along dim 3, rows along dim 1
                per_slot = t.numel() * t.element_size() // (t.shape[1] * t.shape[3])
                slots = sum(n * t.shape[3] // self._slot_capacity() for n in self.quantized)
                used += per_slot * slots
        per_tail_slot = (
            self.tail.numel()
            * self.tail.element_size()
            // (self.tail.shape[2] * self.tail.shape[4])
        )
        return used + per_tail_slot * sum(self.tail_len)

    def _slot_capacity(self) -> int:
        """Token capacity per row of the stores (their slot count maps onto it)."""
        return self.values.codes.shape[3]


@register("int8")
class Int8Cache(QuantizedCache):
    """KIVI with 8-bit codes."""

    @dataclass
    class Options(QuantizedOptions):
        bits: int = 8


@register("int4")
class Int4Cache(QuantizedCache):
    """KIVI with 4-bit codes, two per byte."""

    @dataclass
    class Options(QuantizedOptions):
        bits: int = 4


@register("int2")
class Int2Cache(QuantizedCache):
    """KIVI with 2-bit codes, four per byte."""

    @dataclass
    class Options(QuantizedOptions):
        bits: int = 2
