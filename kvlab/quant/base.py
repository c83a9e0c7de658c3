"""Weight quantization: a config dataclass per method plus one registered transform,
applied in place through :func:`quantize_` (the shape of torchao's ``quantize_``).

Each method swaps the model's ``nn.Linear`` layers for its own layer; which layers stay in
full precision is the config's ``skip`` list (module-name patterns, ``fnmatch`` style).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvlab.kernels.linear import DecodeLinear
from kvlab.registry import Entry, OptionsRegistry


@dataclass
class QuantOptions:
    """Options every quantizer shares. ``skip``: module-name patterns left unquantized (the
    output head by default, as GPTQ and bitsandbytes do; embeddings are never linear)."""

    skip: list[str] = field(default_factory=lambda: ["lm_head"])

    def skipped(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip)


Transform = Callable[[nn.Module, Any], int]  # (model, options) -> layers replaced


_QUANTIZERS = OptionsRegistry("quant.name={name!r} is invalid; allowed: {allowed}", "quant.options")


def register_quantizer(name: str, options: type) -> Callable[[Transform], Transform]:
    """Function decorator: register ``apply(model, options) -> layers replaced``."""
    return _QUANTIZERS.register(name, options)


def registered_quantizers() -> dict[str, Entry]:
    return _QUANTIZERS.entries()


def quant_options(name: str, options: dict[str, Any] | None = None) -> Any:
    """Checked options of quantizer ``name`` (its dataclass names bad fields)."""
    return _QUANTIZERS.options(name, options)


def quantize_(model: nn.Module, name: str, options: dict[str, Any] | Any = None) -> int:
    """Quantize ``model``'s weights in place with quantizer ``name``; returns how many
    layers were replaced. ``options``: a dict of its options or its options object."""
    entry = _QUANTIZERS.entry(name)
    if not isinstance(options, entry.options):
        options = _QUANTIZERS.options(name, options)
    return entry.fn(model, options)


def linear_layers(model: nn.Module, options: QuantOptions) -> Iterator[tuple[str, nn.Linear]]:
    """(qualified name, layer) of every plain ``nn.Linear`` not skipped by ``options`` —
    ``DecodeLinear`` included: a model loaded where the CPU chose kvlab's decode kernel
    holds its linears so, with their own weights (they were silently left unquantized)."""
    for name, module in list(model.named_modules()):
        if type(module) in (nn.Linear, DecodeLinear) and not options.skipped(name):
            yield name, module


def replace_linears(
    model: nn.Module, options: QuantOptions, make: Callable[[str, nn.Linear], nn.Module]
) -> int:
    """Swap every eligible linear layer for ``make(name, layer)``; the count swapped."""
    swapped = 0
    for name, layer in linear_layers(model, options):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, make(name, layer))
        swapped += 1
    return swapped


def held_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers, and what quantized layers keep
    outside them (a layer says so with a ``held_tensors()`` method)."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        extra = getattr(module, "held_tensors", None)
        if callable(extra):
            yield from extra()


@register_quantizer("none", QuantOptions)
def _no_quantization(model: nn.Module, options: QuantOptions) -> int:
    return 0
