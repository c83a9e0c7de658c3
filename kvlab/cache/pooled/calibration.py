"""The calibration of the ``pooled`` policy's learned gate (``cache=compressed
cache.options.gate=calibrated``), its compressor: per layer, a gating projection
(D, 2D) and a position bias (span, 2D), DeepSeek-V4's Z = C W^Z and B (report §2.3), here
fed with the model's own raw keys since no compressor was trained with the model.

Fitted layer by layer, teacher-forced on the full model's q/k/v over calibration text
(WikiText-2 *validation*, never the test text), to minimise the relative squared error
between full attention and compressed attention outputs; starts from uniform pooling.
Saved as safetensors beside a manifest naming the model it was fitted to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvlab.cache.base import CacheOptions, CacheSpec, KVCache, Step, StepInfo
from kvlab.cache.base import strategy as strategy_named
from kvlab.cache.pooled.options import CalibrationOptions
from kvlab.cache.pooled.pooling import LayerPooling, attend_entries, bulk_windows, visible_entries
from kvlab.paths import cache_dir

MANIFEST = "manifest.json"
WEIGHTS = "compressor.safetensors"


# Options that do not change what calibration fits (the gate is "calibrated" whenever a
# compressor is used; observe serves the attention gate; compressor names the file).
NOT_FITTED = ("gate", "observe", "compressor")


def recipe(options: CacheOptions) -> dict[str, Any]:
    """What a compressor depends on besides the model: every other option, and the
    identity of the calibration text it reads."""
    from kvlab.data import calibration_text_id

    fitted = {k: v for k, v in asdict(options).items() if k not in NOT_FITTED}
    calibration = CalibrationOptions(**options.calibration)
    text = calibration_text_id(calibration.source)
    return fitted | {"calibration": asdict(calibration), "calibration_text": text}


def default_dir(model_id: str, options: CacheOptions) -> Path:
    key = hashlib.sha256(json.dumps(recipe(options), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "compressors" / f"{model_id}-{key}"


def prepare(model: torch.nn.Module, options: CacheOptions, strategy: type[KVCache]) -> None:
    """Before caches are built: the calibrated gate's compressor, trained once per model
    (cached on disk) unless ``options.compressor`` names one."""
    if options.gate == "calibrated" and not options.compressor:
        ensure_trained(model, options, strategy)


def load_gates(pools: dict[int, LayerPooling], spec: CacheSpec, options: CacheOptions):
    """The learned gates of a calibrated cache (none to load on the meta device)."""
    if options.gate == "calibrated" and spec.device.type != "meta":
        load_into(pools, spec, options)


def ensure_trained(model: torch.nn.Module, options: CacheOptions, strategy: type[KVCache]) -> Path:
    """The cached compressor of ``model`` for ``options`` (the ``compressed`` strategy's),
    calibrated on first use with ``strategy`` as the student."""
    out = default_dir(model.fingerprint(), options)
    if (out / MANIFEST).exists():
        return out
    calibration = CalibrationOptions(**options.calibration)
    from kvlab.data import calibration_windows

    windows = calibration_windows(
        Path(model.checkpoint_dir),
        calibration.source,
        calibration.samples,
        calibration.seqlen,
        calibration.seed,
        "cache.options",
    )
    save(out, calibrate(model, options, windows, strategy), model.fingerprint(), options)
    return out


def save(out: Path, fitted: dict[str, Any], model_id: str, options: CacheOptions) -> None:
    """Weights as safetensors and a manifest (model, recipe, losses) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in fitted["weights"].items()}, out / WEIGHTS)
    manifest = {"model_id": model_id, "recipe": recipe(options)} | fitted["report"]
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))


def load_into(pools: dict[int, LayerPooling], spec: CacheSpec, options: CacheOptions):
    """Set the learned gates of ``pools`` from the compressor of ``options``; refuse one
    fitted to another model or to another geometry."""
    path = Path(options.compressor).expanduser() if options.compressor else None
    path = path or default_dir(spec.model_id, options)
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(
            f"cache.options.compressor={str(path)!r} holds no trained compressor; allowed: a "
            "directory written by kvlab's calibration (runs calibrate on first use when empty)"
        )
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest["model_id"] != spec.model_id:
        raise ValueError(
            f"cache.options.compressor={str(path)!r} was fitted to model "
            f"{manifest['model_id']}; this model is {spec.model_id}: calibrate one for it"
        )
    weights = load_file(path / WEIGHTS, device=str(spec.device))
    for layer, pool in pools.items():
        proj, bias = weights.get(f"{layer}.proj"), weights.get(f"{layer}.bias")
        expected = [(spec.head_dim, 2 * spec.head_dim), (pool.span, 2 * spec.head_dim)]
        if proj is None or bias is None or [proj.shape, bias.shape] != expected:
            raise ValueError(
                f"cache.options.compressor={str(path)!r} has no gate of layer {layer} with "
                f"shapes {expected}; it was fitted with {manifest['recipe']}"
            )
        pool.proj, pool.bias = proj.float(), bias.float()


class _Recorder(KVCache):
    """The exact cache (``cache=full``), keeping every layer's q, k, v and raw k of the step
    (fp32); the layers a ``student`` compressed cache pools (and its window-only layers)
    attend through the student instead, so later layers see the inputs compression gives
    them."""

    name = "recorder"

    def __init__(self, spec, student=None):
        super().__init__(spec)
        self.exact = strategy_named("full")(spec)
        self.seen: dict[int, tuple[torch.Tensor, ...]] = {}
        self.student = student

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        self.exact.allocate(batch_size, max_tokens)
        if self.student is not None:
            self.student.allocate(batch_size, max_tokens)

    def plan(self, info: StepInfo) -> _RecorderStep:
        student = self.student.plan(info) if self.student is not None else None
        return _RecorderStep(self.exact.plan(info), student)

    def end(self, step: _RecorderStep) -> None:
        self.exact.end(step.own)
        if self.student is not None:
            self.student.end(step.student)

    def attend(self, step: _RecorderStep, layer, q, k, v, k_raw):
        self.seen[layer] = tuple(t.float() for t in (q, k, v, k_raw))
        student = self.student
        if student is not None and (
            layer in student.policy.pools or student.options.layer_kind(layer) == "window"
        ):
            return student.attend(step.student, layer, q, k, v, k_raw)
        return self.exact.attend(step.own, layer, q, k, v, k_raw)

    def tensors(self):
        return self.exact.tensors()

    def used_bytes(self) -> int:
        return self.exact.used_bytes()


@dataclass
class _RecorderStep:
    """The recorder's own (exact) step and its student's."""

    own: Step
    student: Step | None


def record(model: torch.nn.Module, ids: list[int], student=None) -> dict[int, tuple]:
    """q, k, v, k_raw (1, heads, T, D) of every layer of ``model`` over ``ids`` (with the
    layers of ``student`` compressed)."""
    recorder = _Recorder(model.cache_spec(), student)
    recorder.allocate(1, len(ids))
    tokens = torch.tensor([ids], device=recorder.spec.device)
    with torch.no_grad():
        model(tokens, torch.arange(len(ids), device=tokens.device)[None], recorder)
    return recorder.seen


def calibrate(
    model: torch.nn.Module,
    options: CacheOptions,
    windows: list[list[int]],
    strategy: type[KVCache],
) -> dict[str, Any]:
    """Fit the gates of every compressed layer; returns weights and a report of the relative
    error (uniform pooling vs fitted, on the calibration windows) per layer. Layers see the
    full model's inputs, or with ``calibration.sequential`` the inputs the already fitted
    layers below them produce (as GPTQ quantizes layer after layer). ``strategy``: the
    compressed strategy's class, whose uniform-gate cache is the student."""
    start = time.perf_counter()
    student = strategy(model.cache_spec(), dataclasses.replace(options, gate="uniform"))
    pools = student.policy.pools  # the student compresses the layers fitted so far
    student.policy.pools = {}
    sequential = CalibrationOptions(**options.calibration).sequential
    records = None if sequential else [record(model, ids) for ids in windows]
    weights, errors = {}, {}
    for layer, pool in pools.items():
        if sequential:
            samples = [record(model, ids, student)[layer] for ids in windows]
        else:
            samples = [r[layer] for r in records]
        before, after = fit_layer(pool, samples, model.inv_freq, options)
        student.policy.pools[layer] = pool
        weights[f"{layer}.proj"], weights[f"{layer}.bias"] = pool.proj, pool.bias
        errors[str(layer)] = {"uniform": before, "calibrated": after}
    seconds = round(time.perf_counter() - start, 1)
    return {"weights": weights, "report": {"relative_error": errors, "seconds": seconds}}


def fit_layer(pool, samples, inv_freq, options) -> tuple[float, float]:
    """Adam on one layer's (proj, bias) from zero (= uniform pooling); returns the mean
    relative error before and after."""
    calibration = CalibrationOptions(**options.calibration)
    dim, device = samples[0][0].shape[-1], samples[0][0].device
    pool.gate = "calibrated"
    pool.proj = torch.zeros(dim, 2 * dim, device=device, requires_grad=True)
    pool.bias = torch.zeros(pool.span, 2 * dim, device=device, requires_grad=True)
    targets = [_full_attention(q, k, v) for q, k, v, _ in samples]
    optimiser = torch.optim.Adam([pool.proj, pool.bias], lr=calibration.lr)
    before = _mean_error(pool, samples, targets, inv_freq, options)
    for step in range(calibration.steps):
        i = step % len(samples)
        loss = _error(pool, samples[i], targets[i], inv_freq, options)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    pool.proj, pool.bias = pool.proj.detach(), pool.bias.detach()
    return before, _mean_error(pool, samples, targets, inv_freq, options)


def _full_attention(q, k, v) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )


def _mean_error(pool, samples, targets, inv_freq, options) -> float:
    with torch.no_grad():
        errors = [
            _error(pool, s, t, inv_freq, options) for s, t in zip(samples, targets, strict=True)
        ]
    return float(torch.stack(errors).mean())


def _error(pool, sample, target, inv_freq, options: CacheOptions) -> torch.Tensor:
    """||compressed - full||^2 / ||full||^2 over one sequence, attention as the cache
    computes it in one bulk prefill."""
    q, k, v, k_raw = sample
    steps, device = q.shape[2], q.device
    count = steps // pool.ratio
    keys, values = bulk_windows(k_raw, v, q, count, pool, inv_freq.to(device))  # (1, H_kv, N, D)
    positions = torch.arange(steps, device=device)[None]
    visible = visible_entries(positions, count, pool.ratio, options.entries_behind())
    entries = (keys, values, visible)
    causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
    sinks = torch.arange(steps, device=device) < options.sinks
    band = (causal.triu(-(options.window - 1)) | (causal & sinks))[None, None]  # (1, 1, T, T)
    bias = math.log(pool.ratio) if options.proportional else 0.0
    out = attend_entries(q, entries, (k, v, band), pool.top_k, bias)
    return (out - target).square().sum() / target.square().sum()
