"""Top-k entry selection for compressed sparse attention (DeepSeek-V4's indexer) on the CPU
in one C call per layer (``indexer.c``): scores of the visible entries and the k highest
in one pass over their keys, where torch runs a matmul, a masked fill and a top-k over a
materialised score tensor."""

from __future__ import annotations

import torch

from kvlab.kernels.build import INT, INT64, POINTER, kernel, library

# (q, q_bf16, R, H, G, D, keys, k_bf16, s_row, s_head, s_slot, seen, base, top_k, out)
_ARGS = (POINTER, INT, INT64, INT64, INT64, INT64, POINTER, INT, INT64, INT64, INT64, POINTER,
         POINTER, INT64, POINTER)  # fmt: skip
_FLOATS = (torch.float32, torch.bfloat16)


def top_k_table(
    queries: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, base: torch.Tensor, top_k: int
) -> torch.Tensor | None:
    """(B * H_kv, top_k) table entries ``base + j`` of each (row, KV head)'s ``top_k``
    visible entries j (of the first ``seen`` (B,)) scored highest by its queries
    (B, H_kv, G, D) summed over G, dotted with keys (B, H_kv, N, D); in entry order, the
    first min(seen, top_k) filled. None where the kernel does not apply (another device or
    dtype, a compiled step, no library): the caller's torch path runs."""
    if (
        queries.device.type != "cpu"
        or queries.dtype not in _FLOATS
        or keys.dtype not in _FLOATS
        or keys.stride(-1) != 1
        or torch.compiler.is_compiling()
        or library() is None
    ):
        return None
    batch, heads, group, dim = queries.shape
    q = queries.contiguous()
    seen, base = seen.to(torch.int64).contiguous(), base.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(batch * heads, top_k, dtype=torch.int64)
    kernel("kvlab_top_k_entries", *_ARGS)(
        q.data_ptr(), int(q.dtype == torch.bfloat16), batch * heads, heads, group, dim,
        keys.data_ptr(), int(keys.dtype == torch.bfloat16), keys.stride(0), keys.stride(1),
        keys.stride(2), seen.data_ptr(), base.data_ptr(), top_k, out.data_ptr(),
    )  # fmt: skip
    return out
