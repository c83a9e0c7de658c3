"""Options of the ``pooled`` policy (``cache=compressed``, ``csa``, ``hca``) and of the
calibration that fits its learned gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from kvlab.cache.pooled.pooling import GATES, LayerPooling

KINDS = ("csa", "hca", "window")


@dataclass
class CalibrationOptions:
    """``cache.options.calibration``: text, windows drawn from it, and the optimiser."""

    source: str = "wikitext2-valid"
    samples: int = 4
    seqlen: int = 1024
    steps: int = 48
    lr: float = 0.01
    seed: int = 0
    sequential: bool = False  # fit each layer on the inputs the fitted layers below give it

    def __post_init__(self) -> None:
        for name in ("samples", "seqlen", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"cache.options.calibration.{name}={getattr(self, name)} must be >= 1"
                )
        if self.lr <= 0:
            raise ValueError(f"cache.options.calibration.lr={self.lr} must be > 0")


def calibration_defaults() -> dict[str, Any]:
    """``cache.options.calibration`` when not given: :class:`CalibrationOptions`' defaults."""
    return asdict(CalibrationOptions())


@dataclass
class PooledOptions:
    schedule: list[str] = field(default_factory=lambda: ["csa", "hca"])  # cycled over layers
    csa_ratio: int = 4
    hca_ratio: int = 128
    window: int = 128
    sinks: int = 4  # first tokens kept exactly (StreamingLLM's sinks; V4 learns sink logits)
    rollback: ClassVar[int] = 0  # no ring margin: pooled entries cannot be rolled back
    top_k: int = 512  # CSA entries each query keeps (V4-Flash's index_topk); 0: all
    overlap: bool = True  # CSA entries pool 2 * csa_ratio tokens
    proportional: bool = False  # an entry's logit + log(ratio): it stands for ratio tokens
    in_window: bool = True  # V4: entries visible once closed; false: once out of the window
    gate: str = "uniform"
    observe: int = 8  # attention gate: a window's last queries that score its tokens
    compressor: str = ""  # calibrated gate: a trained compressor directory ("": the cached one)
    calibration: dict = field(default_factory=calibration_defaults)  # CalibrationOptions

    def __post_init__(self) -> None:
        self.schedule = list(self.schedule)
        bad = [kind for kind in self.schedule if kind not in KINDS]
        _check(not bad and self.schedule, "schedule", self.schedule, f"a list of {KINDS}")
        _check(self.gate in GATES, "gate", self.gate, str(GATES))
        for name in ("csa_ratio", "hca_ratio", "observe"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0: every entry)")
        _check(self.sinks >= 0, "sinks", self.sinks, ">= 0")
        exact_only = self.ratios_used() == {1} and not self.overlap and self.sinks == 0
        _check(
            self.window >= 1 or exact_only,
            "window",
            self.window,
            ">= 1 (0 only when every layer pools windows of 1 token without overlap or sinks)",
        )
        CalibrationOptions(**self.calibration)

    def entries_behind(self) -> int:
        """How far behind a query an entry's tokens must be before it sees the entry."""
        return 0 if self.in_window else self.window

    def ratios_used(self) -> set[int]:
        return {self.ratio(kind) for kind in self.schedule}

    def ratio(self, kind: str) -> int:
        return {"csa": self.csa_ratio, "hca": self.hca_ratio, "window": 0}[kind]

    def layer_kind(self, layer: int) -> str:
        return self.schedule[layer % len(self.schedule)]

    def poolings(self, num_layers: int) -> dict[int, LayerPooling]:
        """How each layer that pools does so (window-only layers are not listed)."""
        pools = {}
        for layer in range(num_layers):
            kind = self.layer_kind(layer)
            if kind != "window":
                csa, ratio = kind == "csa", self.ratio(kind)
                top_k = self.top_k if csa else 0
                pools[layer] = LayerPooling(
                    ratio, self.overlap and csa, top_k, self.gate, self.observe
                )
        return pools


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"cache.options.{name}={value!r} is invalid; allowed: {allowed}")
