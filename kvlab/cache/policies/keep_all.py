"""``keep_all``: every key and value kept, token t of a row in logical slot t; exact by
construction. A decode step reads every stored token in place, planned as data (its
``reads``: tokens [0, end) of each row, which the fused decode layer runs in C), and so does
a short step where the store allows it (a query row per token: a verification over KIVI
codes reads them where they lie); other multi-token steps attend over the stored prefix,
causal on a first prefill (over its own keys and values where the store holds them
exactly: nothing to read back), else under the mask of :mod:`kvlab.cache.masks` — through the
kernel plan's prefill attention where key column j holds position j (kvlab's C kernel for
bf16 where the CPU has it), else SDPA. Over the contiguous store this is ``full``
(gpt-fast's static cache), over the paged store ``paged`` (vLLM's PagedAttention); in token
codes the step's own tokens are read back as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.cache.base import DecodeReads, Step, row_bounds, sdpa
from kvlab.cache.masks import slot_positions, visible
from kvlab.cache.policies.base import Policy, check_room
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import decode_attention
from kvlab.kernels.attention import prefill
from kvlab.kernels.attention.sinks import current_sinks


@dataclass
class KeepAllStep(Step):
    """``where``: the store's placement of the new tokens; ``origin`` (B,) zeros (every
    stored token is visible to a decode query); ``in_place``: the step is attended through
    the decode kernel, a query row per token; else ``read``: slots a multi-token step
    attends over, ``mask`` (B, 1, T, read), None for plain causal attention."""

    where: Any
    origin: torch.Tensor
    in_place: bool = True
    read: int = 0
    mask: torch.Tensor | None = None
    positional: bool = True  # key column j holds position j (no store's own layout)


class KeepAll(Policy):
    name = "keep_all"
    stores = ("contiguous", "paged")
    Step: type[KeepAllStep] = KeepAllStep  # a policy that extends keep_all extends its step

    def plan(self, info, lengths, store, static) -> KeepAllStep:
        start, end = row_bounds(lengths, info)
        steps, longest = check_room(lengths, info, store.capacity), max(lengths, default=0)
        slots = slot_positions(start, steps)  # (B, T)
        real = torch.arange(steps, device=start.device)[None] < (end - start)[:, None]
        where = store.place(lengths, info, slots, real)
        in_place = steps <= store.in_place_steps()
        step = self.Step(info, start, end, where, torch.zeros_like(start), in_place)
        if in_place and step.decode:
            step.reads = DecodeReads(where, step.origin, end)
        if not in_place:
            step.read = longest + steps
            held = store.held(where, step.read)
            if held is not None:
                step.mask, step.positional = visible(slots, held), False
            elif longest:
                step.mask = visible(slots, torch.arange(step.read, device=start.device))
        return step

    def attend_steps(self, step, store, layer, q, k, v, k_raw):
        if step.in_place:
            store.write(step.where, layer, k, v)
            queries = grouped(q, self.spec.num_kv_heads)
            segments = store.segments(step.where, layer, queries, step.origin, step.end)
            if not step.decode:
                segments = [s.per_token(step.start, step.info.steps) for s in segments]
            return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        if step.read == step.info.steps and step.positional and store.exact:
            store.write(step.where, layer, k, v)  # every row's first tokens: they are its
            keys, values = k, v  # whole context, exactly as a read would give them back
        else:
            keys, values = store.context(step.where, layer, k, v, step.read)
        if step.positional and runs_prefill_kernel(q, keys, values):
            return prefill.prefill_attention(q, keys, values, step.start, q.shape[-1] ** -0.5)
        return sdpa(q, keys, values, mask=step.mask, causal=step.mask is None)


def runs_prefill_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether a multi-token step's attention goes through kvlab's C prefill kernel: the
    kernel plan names it, the tensors fit it, no attention sinks join the softmax."""
    from kvlab.kernels.plan import default_plan  # a cycle at import: plan, quant, caches

    return (
        default_plan().prefill_attention == "kvlab"
        and current_sinks() is None
        and prefill.fits(q, keys, values)
    )
