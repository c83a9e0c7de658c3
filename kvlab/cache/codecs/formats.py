"""The per-token formats ``cache.options.kv_format`` names, registered by the codec files
that define them (integer codes, fp8, fp4, codebooks; one file each, found with the codecs
folder): how many bits a channel each takes (``kv_bits``), the channels a scale must cover
where the format fixes them, the rotation it quantizes after, and the codec it is for a
head of a given size. Options, tests, the error table and the report labels read this
registry, so a format is one file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_FORMATS: dict[str, TokenFormat] = {}


@dataclass(frozen=True)
class TokenFormat:
    """``bits``: the ``kv_bits`` it takes; ``block``: the ``kv_group_size`` it requires
    (None: any divisor of head_dim); ``rotation``: the ``rotate`` it requires (None: any);
    ``make(options, head_dim)``: its codec; ``describe(options)``: its storage in words."""

    name: str
    bits: tuple[int, ...]
    make: Callable[[Any, int], Any]
    describe: Callable[[Any], str]
    block: int | None = None
    rotation: str | None = None

    def check(self, options) -> None:
        """Refuse options that contradict the format (the field, the value, what is
        allowed)."""
        if options.kv_bits not in self.bits and len(self.bits) > 1:
            raise ValueError(
                f"cache.options.kv_bits={options.kv_bits} is invalid with kv_format="
                f"{self.name!r}; allowed: 0, {self.bits}"
            )
        if options.kv_bits not in self.bits:
            width = self.bits[0]
            raise ValueError(
                f"cache.options.kv_format={self.name!r} is {'an' if width == 8 else 'a'} "
                f"{width}-bit format but kv_bits={options.kv_bits}; allowed: kv_bits={width} "
                "with it"
            )
        if self.block is not None and options.kv_group_size != self.block:
            raise ValueError(
                f"cache.options.kv_group_size={options.kv_group_size} with kv_format="
                f"{self.name}, which scales blocks of {self.block}; allowed: {self.block}"
            )
        if self.rotation is not None and options.rotate != self.rotation:
            raise ValueError(
                f"cache.options.rotate={options.rotate!r} with kv_format={self.name}, which "
                f"quantizes rotated coordinates; allowed: rotate={self.rotation!r}"
            )


def register_format(token_format: TokenFormat) -> TokenFormat:
    """Register ``token_format`` under its name (a ``kv_format`` value)."""
    if token_format.name in _FORMATS:
        raise ValueError(f"kv_format {token_format.name!r} is registered twice")
    _FORMATS[token_format.name] = token_format
    return token_format


def token_formats() -> dict[str, TokenFormat]:
    """Name -> format of every registered ``kv_format``."""
    return dict(_FORMATS)


def token_format(name: str) -> TokenFormat:
    if name not in _FORMATS:
        raise ValueError(
            f"cache.options.kv_format={name!r} is invalid; allowed: {tuple(sorted(_FORMATS))}"
        )
    return _FORMATS[name]
