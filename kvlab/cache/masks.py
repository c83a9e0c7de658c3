"""One small mask algebra for every strategy (FlexAttention's ``mask_mod`` idea): a key is
described by the position it holds (-1: an empty slot), a query by its position, and
visibility is composed from those alone — causal, padding, sinks + window, blocks and
pooled entries are all positions, so no strategy needs a mask builder of its own.

- a contiguous cache: key j holds position j;
- a ring or a paged table: the position each slot holds (``slot_positions``);
- a pooled entry (DeepSeek-V4 CSA/HCA): the position at which it becomes visible
  (``entry_positions``): the last token of its window, plus ``behind`` when entries wait
  until their tokens have left an exact window.
"""

from __future__ import annotations

import torch


def visible(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int = 0, sinks: int = 0
) -> torch.Tensor:
    """(B, 1, T, L) boolean: query i of row b sees key j iff the key holds a position
    (>= 0) at or before the query's, and, with a ``window``, that position is one of the
    ``sinks`` first or among the ``window`` most recent (the query's own included).

    ``query_pos`` (B, T); ``key_pos`` (B, L) or (L,) shared by every row."""
    q = query_pos[:, :, None]  # (B, T, 1)
    k = key_pos[None, None, :] if key_pos.dim() == 1 else key_pos[:, None, :]  # (B|1, 1, L)
    seen = (k >= 0) & (k <= q)
    if window:
        seen &= (k > q - window) | (k < sinks)
    return seen[:, None]


def entry_positions(count: int, ratio: int, behind: int, device: torch.device) -> torch.Tensor:
    """(count,) the position from which pooled entry w (tokens w*ratio .. (w+1)*ratio - 1)
    is visible: its window's last token, ``behind`` tokens later when it waits for its
    tokens to leave an exact window of that size."""
    return (torch.arange(count, device=device) + 1) * ratio - 1 + behind


def slot_positions(start: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count) positions start[b] + i: a step's new tokens, or a contiguous store."""
    return start[:, None] + torch.arange(count, device=start.device)
