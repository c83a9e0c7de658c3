"""Whether a run's decode steps run under ``torch.compile`` (``engine.compile``): ``true``,
``false``, or ``auto`` (the default) — compiled where it measurably wins on this machine for
this model, weight format and cache strategy.

``auto`` times the two once: an eager and a compiled engine (a static cache) decode the
same prompt of PROBE_PROMPT random tokens in turns, and the compiled one is kept when its
median ITL is MARGIN faster. The choice is cached under ``$KVLAB_CACHE/compile_choice``,
keyed by the device (CPU model and flags, or the GPU), threads, torch version, kernel build,
the model's fingerprint and weight formats, and the cache strategy with its options; it is
recorded in result.json. A compile that fails keeps eager (with the reason). Runs that
cannot gain stay eager without timing: serving (the batch changes shape every few steps)
and runs of fewer than MIN_STEPS decode steps (a compile would not pay for itself).

Measured on one Xeon (2 threads, SmolLM2-135M, ``full``, 1024 tokens, eager ITL → compiled):
fp32 33.6 → 28.5 ms, bf16 22.7 → 22.5, int8 20.7 → 16.9, int4 16.6 → 12.4; a compiled KIVI
``int4`` cache had lost to eager (it quantizes a group every step to keep one graph), which
is why the choice is made per strategy.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics

import torch

from kvlab.engine.generate import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.kernels.build import cpu_identity, library_identity
from kvlab.paths import cache_dir

MIN_STEPS = 64
PROBE_PROMPT, PROBE_STEPS, ROUNDS = 256, 16, 3
MARGIN = 0.03


def compile_choice(setting, model, new_cache, cache_key: str, steps: int, serving: bool) -> dict:
    """``{"compile": bool, "reason": str, ...}`` for ``engine.compile=setting``;
    ``new_cache(static=...)`` builds the run's cache, ``cache_key`` names it and its
    options, ``steps`` is the run's decode steps per generation."""
    if setting is not None and setting != "auto":
        return {"compile": bool(setting), "reason": f"engine.compile={setting}"}
    if serving:
        return {"compile": False, "reason": "serving: the batch changes shape every few steps"}
    if steps < MIN_STEPS:
        reason = f"{steps} decode steps < {MIN_STEPS}: a compile would not pay for itself"
        return {"compile": False, "reason": reason}
    path = cache_dir() / "compile_choice" / f"{_key(model, cache_key)}.json"
    if path.exists():
        return json.loads(path.read_text()) | {"cached": True}
    choice = _timed(model, new_cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=1))
    return choice


def _timed(model, new_cache) -> dict:
    """Eager and compiled ITL (median of ROUNDS turns, ms) on a probe prompt."""
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(PROBE_PROMPT)]
    cfg = GenerationConfig(PROBE_STEPS, stop_on_eos=False)
    engines = {"eager": Engine(model, new_cache(static=False))}
    try:
        engines["compiled"] = Engine(model, new_cache(static=True), compile=True)
        for engine in engines.values():
            engine.generate([prompt], cfg)  # warm-up; the compiled one compiles here
    except Exception as error:  # noqa: BLE001 — any failure to compile keeps eager
        return {"compile": False, "reason": f"compiling failed: {type(error).__name__}: {error}"}
    itl: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name, engine in engines.items():
            steps = engine.generate([prompt], cfg).stats.step_s
            itl[name].append(percentile(steps, 50) * 1e3)
    ms = {name: statistics.median(times) for name, times in itl.items()}
    wins = ms["compiled"] < (1 - MARGIN) * ms["eager"]
    verdict = "faster" if wins else f"not {MARGIN:.0%} faster"
    reason = f"timed: compiled {ms['compiled']:.2f} ms vs eager {ms['eager']:.2f} ms, {verdict}"
    return {"compile": wins, "reason": reason, "itl_ms": ms}


def _key(model, cache_key: str) -> str:
    weight = model.embed_tokens.weight
    device = torch.cuda.get_device_name(weight.device) if weight.is_cuda else cpu_identity()
    formats = sorted({
        f"{type(m).__name__}:{t.dtype}"
        for m in model.modules()
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    })  # fmt: skip
    parts = (device, str(torch.get_num_threads()), torch.__version__, library_identity(),
             model.fingerprint(), ",".join(formats), cache_key,
             f"{PROBE_PROMPT}/{PROBE_STEPS}/{MARGIN}")  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
