"""Tensors a decode step streams, on 2 MiB pages where the OS gives them (Linux transparent
huge pages, asked for per mapping with ``madvise(MADV_HUGEPAGE)``).

Decode reads every weight once a step, so its speed is a streaming read's; through 4 KiB
pages that read pays a TLB miss every 4 KiB and its hardware prefetch stops at every page
boundary (``experiments/engine_vs_llamacpp/harness/page_read.c`` and ``gemv_stack.c``
measure both kinds of page). torch's allocator leaves a
tensor on whatever pages malloc's mapping gets: on 4 KiB ones wherever THP is
``madvise`` (the default of many distributions). So a loaded model's
parameters and buffers move into one private mapping advised before its first touch
(:func:`move_to_huge_pages`). Where the OS gives no huge pages the mapping is plain
memory and nothing else changes; :func:`huge_bytes` says what it got (from
``/proc/self/smaps``), and ``result.json`` records it. KV stores allocate their tensors
through :func:`zeros` where the model's spec asks for huge pages (a full fp32 cache at 4096
tokens is another 190 MB a step).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
MIN_BYTES = HUGE_PAGE  # zeros() maps what fills at least this much, torch allocates the rest
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mode() -> str | None:
    """The OS's transparent huge page setting (``always``, ``madvise``, ``never``), None
    where there is none to read."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def supported() -> bool:
    """Whether this OS can back an advised mapping with huge pages: Linux with transparent
    huge pages not ``never``."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return mode() not in (None, "never")


def empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 in a private anonymous mapping advised for huge pages before any
    page of it is touched, its first byte on a 2 MiB boundary; the mapping lives as long
    as the tensor or any view of it. The slack around it is made inaccessible, which also
    keeps the kernel from merging the mapping with a neighbour, so :func:`huge_bytes`
    counts this mapping's pages alone."""
    page = mmap.PAGESIZE
    span = -(-nbytes // page) * page
    region = mmap.mmap(-1, span + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive
    base = whole.data_ptr()
    skip = -(base + page) % HUGE_PAGE + page  # at least one page of slack before
    _guard(base, skip)
    _guard(base + skip + span, len(region) - skip - span)
    _advise(base + skip, span)
    return whole[skip : skip + nbytes]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("mprotect", "madvise"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _guard(address: int, length: int) -> None:
    """No access to [address, address + length): a mapping of its own."""
    if length > 0:
        _libc().mprotect(address, length, 0)  # PROT_NONE; where it fails, only merging


def _advise(address: int, length: int) -> None:
    _libc().madvise(address, length, mmap.MADV_HUGEPAGE)


def zeros(
    layout: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str
) -> list[torch.Tensor]:
    """Zero tensors of ``layout``'s (shape, dtype)s; on the CPU, where huge pages are
    supported and they fill at least one, views into one mapping from :func:`empty`, each
    on a cache line. The mapping is written (zeros) here, so its pages are faulted in
    before any step runs: under a hypervisor that takes free guest memory back (free page
    reporting hands it 2 MiB blocks, exactly what a huge page needs), the first touch of a
    huge page costs milliseconds, which a serving pool or a run's cache would otherwise pay
    inside the steps that first write it — steps a persistent cache never pays for."""
    device = torch.device(device)
    sizes = [_lines(math.prod(shape) * t.itemsize) for shape, t in layout]
    if device.type != "cpu" or sum(sizes) < MIN_BYTES or not supported():
        return [torch.zeros(shape, dtype=t, device=device) for shape, t in layout]
    arena, at, out = empty(sum(sizes)), 0, []
    arena.zero_()  # the first touch, on torch's threads
    for (shape, t), size in zip(layout, sizes, strict=True):
        out.append(arena[at : at + math.prod(shape) * t.itemsize].view(t).view(shape))
        at += size
    return out


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds ``t`` that the OS backs with huge pages (0 where it
    cannot tell)."""
    return _mapping_bytes(t, "AnonHugePages:")


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds ``t`` in memory now (0 where it cannot tell)."""
    return _mapping_bytes(t, "Rss:")


def _mapping_bytes(t: torch.Tensor, field: str) -> int:
    """``field`` (kB) of the ``/proc/self/smaps`` entry of the mapping that holds ``t``, in
    bytes."""
    address = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def _tensors(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, tensor) of every plain strided CPU parameter and buffer, each owner's
    once (subclasses that carry state of their own, as bitsandbytes' parameters, and
    oneDNN's opaque tensors stay where they are)."""
    found = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            found += [(owner, n, t) for n, t in table.items() if _movable(t)]
    return found


def _movable(t: torch.Tensor | None) -> bool:
    return (
        t is not None
        and type(t) in (torch.Tensor, nn.Parameter)
        and t.is_cpu
        and t.layout == torch.strided
        and t.numel() > 0
    )


def move_to_huge_pages(module: nn.Module) -> torch.Tensor | None:
    """Every CPU parameter and buffer of ``module`` into one mapping from :func:`empty`;
    returns that mapping's bytes, or None where huge pages are not supported or nothing is
    on the CPU. What moves is the bytes the tensors use, each storage's overlapping uses
    as one piece, so ties and views stay shared, and a storage used only in part (a
    mapping of an earlier move, holding what is still used of it) moves only that part.
    The fused decode plans, which hold the old addresses, are dropped."""
    if not supported():
        return None
    from kvlab.models.fused_layer import weights_changed

    entries = [(o, name, _Geometry(t), t.untyped_storage()) for o, name, t in _tensors(module)]
    pieces = _pieces([(storage, geometry) for _, _, geometry, storage in entries])
    sizes = [_lines(hi - lo) for _, lo, hi in pieces]
    if sum(sizes) == 0:  # nothing on the CPU (a CUDA model)
        return None
    arena, at, placed = empty(sum(sizes)), 0, []  # placed: (storage address, lo, hi, byte)
    for (storage, lo, hi), size in zip(pieces, sizes, strict=True):
        arena[at : at + hi - lo].copy_(_bytes_of(storage)[lo:hi])
        placed.append((storage.data_ptr(), lo, hi, at))
        at += size
    for owner, name, geometry, storage in entries:
        start = geometry.byte_range()[0]
        lo, where = next((lo, where) for key, lo, hi, where in placed
                         if key == storage.data_ptr() and lo <= start < hi)  # fmt: skip
        moved = _view(arena, where + start - lo, geometry)
        if name in owner._parameters:
            owner._parameters[name].data = moved
        else:
            owner._buffers[name] = moved
    weights_changed()
    return arena


def _pieces(uses: list) -> list[tuple[torch.UntypedStorage, int, int]]:
    """(storage, lo, hi): the byte ranges of each storage that (storage, geometry) uses
    cover, overlapping or touching ones merged, lo down to a cache line (so every tensor
    keeps its address modulo 64 where it moves)."""
    ranges: dict[int, list] = {}
    storages = {}
    for storage, geometry in uses:
        storages[storage.data_ptr()] = storage
        lo, hi = geometry.byte_range()
        ranges.setdefault(storage.data_ptr(), []).append((lo // ALIGN * ALIGN, hi))
    pieces = []
    for key, spans in ranges.items():
        spans.sort()
        merged = [list(spans[0])]
        for lo, hi in spans[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        pieces += [(storages[key], lo, hi) for lo, hi in merged]
    return pieces


def put_on_huge_pages(model: nn.Module) -> None:
    """:func:`move_to_huge_pages`, and what came of it, on the model: ``huge_pages`` (its
    caches' stores then allocate on huge pages too, ``Decoder.cache_spec``) and
    ``huge_page_bytes`` (what the OS backed)."""
    arena = move_to_huge_pages(model)
    model.huge_pages = arena is not None
    model.huge_page_bytes = 0 if arena is None else huge_bytes(arena)


def summary(model: nn.Module) -> str:
    """How much of ``model``'s weights lie on huge pages, for a benchmark's header."""
    from kvlab.engine.metrics import weight_bytes

    held = getattr(model, "huge_page_bytes", 0)  # 0 for a module no run loaded
    return f"{held / 2**20:.0f} of {weight_bytes(model) / 2**20:.0f} MiB of weights on 2 MiB pages"


def _lines(nbytes: int) -> int:
    """``nbytes`` rounded up to whole cache lines (ALIGN)."""
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor over the same memory."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


class _Geometry:
    """A tensor's dtype, shape, strides and offset in its storage, as they were."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self.shape, self.stride = t.dtype, t.shape, t.stride()
        self.offset, self.itemsize = t.storage_offset(), t.element_size()

    def byte_range(self) -> tuple[int, int]:
        """The bytes of its storage it reads, [first, past the last)."""
        extent = 1 + sum((n - 1) * step for n, step in zip(self.shape, self.stride, strict=True))
        return self.offset * self.itemsize, (self.offset + extent) * self.itemsize


def _view(arena: torch.Tensor, at: int, t: _Geometry) -> torch.Tensor:
    """A tensor of geometry ``t`` whose first element is at byte ``at`` of ``arena``."""
    start = (arena.storage_offset() + at) // t.itemsize
    return torch.empty(0, dtype=t.dtype).set_(arena.untyped_storage(), start, t.shape, t.stride)
