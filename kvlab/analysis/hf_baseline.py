"""Hugging Face transformers ``generate`` as a timed reference: per-token timestamps from a
streamer, and the bytes its cache objects hold (quanto's packed tensors included)."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """Records when ``generate`` emits each token (its first ``put`` is the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def timed_generate(model, prompt: list[int], new_tokens: int, **kwargs: Any):
    """Greedy ``new_tokens`` tokens: (TTFT s, per-step ITL s, tokens, generate's output)."""
    clock = TokenClock()
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        pad_token_id=0,
        return_dict_in_generate=True,
        **kwargs,
    )
    emitted = clock.times[1:]
    itl = [b - a for a, b in zip(emitted, emitted[1:], strict=False)]
    return emitted[0] - clock.start, itl, out.sequences[0, len(prompt) :].tolist(), out


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``obj`` (lists, dicts, attributes), counting
    wrapper tensors (quanto's QTensor) by their inner data and each storage once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type | torch.nn.Module):
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    return 0
