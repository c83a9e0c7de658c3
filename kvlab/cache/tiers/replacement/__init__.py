"""Replacement policies of a slow KV tier: which block leaves when a full tier takes a new
one. One file each, registered by name with :func:`replacement` (every file of this folder
is imported here), chosen by ``cache.options.slow_eviction``."""

from __future__ import annotations

from collections.abc import Hashable

from kvlab.registry import import_folder

_POLICIES: dict[str, type[Replacement]] = {}


class Replacement:
    """Resident keys of a tier of ``capacity`` blocks. :meth:`admit` makes room for a new
    key and returns the keys to drop (the tier frees their records); :meth:`hit` records a
    use of a resident key. A policy holds keys only, never data."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def admit(self, key: Hashable) -> list[Hashable]:
        raise NotImplementedError

    def hit(self, key: Hashable) -> None:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


def replacement(name: str):
    """Class decorator: register a replacement policy under ``name``."""

    def wrap(cls: type[Replacement]) -> type[Replacement]:
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return wrap


def replacements() -> dict[str, type[Replacement]]:
    """The registered policies by name."""
    return dict(_POLICIES)


def check_replacement(name: str) -> None:
    """Refuse a policy name no file registered, naming those that are."""
    if name not in _POLICIES:
        raise ValueError(
            f"cache.options.slow_eviction={name!r} is unknown; allowed: "
            f"{', '.join(sorted(_POLICIES))}"
        )


def make_replacement(name: str, capacity: int) -> Replacement:
    check_replacement(name)
    return _POLICIES[name](capacity)


import_folder(__name__)  # every policy file registers itself
