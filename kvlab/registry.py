"""A name → (options dataclass, function) registry, shared by the evals and the weight
quantizers: register with a decorator, check options by name with an error that names the
field, the bad value and what is allowed; and :func:`import_folder`, which imports every
module of an axis folder so that a method registers itself by being one file there."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    options: type
    fn: Callable[..., Any]


class OptionsRegistry:
    """``unknown``: the error for an unregistered name, formatted with ``name``, ``known``
    (the sorted list) and ``allowed`` (the names joined by commas)."""

    def __init__(self, unknown: str, field: str):
        self.unknown, self.field = unknown, field  # field: "quant.options", "eval.{name}"
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, options: type) -> Callable[[Callable], Callable]:
        """Function decorator: register ``fn`` under ``name`` with its options dataclass."""

        def wrap(fn: Callable) -> Callable:
            self._entries[name] = Entry(options, fn)
            return fn

        return wrap

    def entries(self) -> dict[str, Entry]:
        return dict(self._entries)

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            known = sorted(self._entries)
            message = self.unknown.format(name=name, known=known, allowed=", ".join(known))
            raise ValueError(message)
        return self._entries[name]

    def options(self, name: str, values: dict[str, Any] | None = None) -> Any:
        """Checked options of ``name`` (its dataclass names bad fields)."""
        return checked_options(self.entry(name).options, values, self.field.format(name=name))


def checked_options(options_type: type, values: dict[str, Any] | None, field: str) -> Any:
    """``options_type(**values)``, refusing keys it does not have with kvlab's message (the
    field, the value and the known options) instead of a TypeError."""
    import dataclasses

    values = dict(values or {})
    known = [f.name for f in dataclasses.fields(options_type)]
    for key, value in values.items():
        if key not in known:
            raise ValueError(
                f"{field}.{key}={value!r} is not an option; allowed: {', '.join(known)}"
            )
    return options_type(**values)


def import_folder(package: str) -> list[str]:
    """Import every module of ``package`` (its folder's ``*.py``, in name order), so each
    registers what it defines: a new method is one file in its axis folder, found here, and
    every test, sweep and benchmark reads the registry it filled. The modules' names."""
    folder = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(folder.__path__) if not m.ispkg)
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names
