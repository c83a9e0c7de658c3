"""Whether a run's decode steps run under ``torch.compile`` (``engine.compile``): ``true``,
``false``, or ``auto`` (the default), decided the same way every run:

- on the CPU, eager: kvlab's decode step runs each decoder layer (the cache's writes and
  attention inside) in one C call (:mod:`kvlab.models.fused_layer`), which a compiled graph
  cannot call into;
- on CUDA, compiled (CUDA graphs: a decode step is many small kernels) where the strategy
  builds a static cache;
- runs that cannot gain stay eager: serving (the batch changes shape every few steps) and
  runs of fewer than MIN_STEPS decode steps (a compile would not pay for itself).

With ``engine.autotune=true`` an ``auto`` choice is timed instead, in this process: an eager
and a compiled engine (a static cache) decode the same prompt of PROBE_PROMPT random tokens
in turns, and the compiled one is kept when its median ITL is MARGIN faster; the timing is
recorded in result.json, never persisted. A compile that fails keeps eager (with the
reason).
"""

from __future__ import annotations

import random
import statistics

from kvlab.engine.generate import Engine, GenerationConfig
from kvlab.engine.timing import percentile

MIN_STEPS = 64
PROBE_PROMPT, PROBE_STEPS, ROUNDS = 256, 16, 3
MARGIN = 0.03


def compile_choice(
    setting, model, new_cache, steps: int, serving: bool, autotune: bool = False
) -> dict:
    """``{"compile": bool, "reason": str, ...}`` for ``engine.compile=setting``;
    ``new_cache(static=...)`` builds the run's cache, ``steps`` is the run's decode steps per
    generation; ``autotune``: time an ``auto`` choice (see the module docstring)."""
    hf = getattr(model, "backend", "native") == "hf"  # its cache rides a keyword argument
    if hf and setting not in (None, "auto", False):
        raise ValueError(f"engine.compile={setting} with model.backend=hf; allowed: auto, false")
    if setting is not None and setting != "auto":
        return {"compile": bool(setting), "reason": f"engine.compile={setting}"}
    if hf:
        return {"compile": False, "reason": "model.backend=hf: eager (not compiled yet)"}
    if serving:
        return {"compile": False, "reason": "serving: the batch changes shape every few steps"}
    if steps < MIN_STEPS:
        reason = f"{steps} decode steps < {MIN_STEPS}: a compile would not pay for itself"
        return {"compile": False, "reason": reason}
    if autotune:
        return _timed(model, new_cache)
    if model.embed_tokens.weight.is_cuda:
        try:
            new_cache(static=True)  # a strategy without a static layout cannot compile
        except Exception as error:  # noqa: BLE001 — it says why; eager runs it
            return {"compile": False, "reason": f"no static cache: {type(error).__name__}: {error}"}
        return {"compile": True, "reason": "auto on CUDA: CUDA graphs over the decode step"}
    return {"compile": False, "reason": "auto on the CPU: the fused C decode layers run eager"}


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
    reason = f"autotune: compiled {ms['compiled']:.2f} ms vs eager {ms['eager']:.2f} ms, {verdict}"
    return {"compile": wins, "reason": reason, "itl_ms": ms}
