"""engine.compile=auto: decided the same way every run (eager on the CPU, where the fused
C decode layers run; compiled on CUDA); timed in this process only with engine.autotune,
never persisted; runs that cannot gain stay eager without a timing."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import cache_factory
from kvlab.engine import compile_choice as choice_module
from kvlab.engine.compile_choice import MIN_STEPS, compile_choice


@pytest.fixture
def new_cache(tiny_llama):
    return cache_factory("full", tiny_llama, {})


def test_a_set_value_is_kept_and_short_or_serving_runs_stay_eager(tiny_llama, new_cache):
    for setting in (True, False):
        choice = compile_choice(setting, tiny_llama, new_cache, 1000, serving=False)
        assert choice == {"compile": setting, "reason": f"engine.compile={setting}"}
    short = compile_choice("auto", tiny_llama, new_cache, MIN_STEPS - 1, serving=False)
    assert not short["compile"] and f"< {MIN_STEPS}" in short["reason"]
    serving = compile_choice("auto", tiny_llama, new_cache, 1000, serving=True)
    assert not serving["compile"] and "serving" in serving["reason"]


def test_auto_is_eager_on_the_cpu_without_a_timing(tiny_llama, new_cache, monkeypatch):
    monkeypatch.setattr(choice_module, "_timed", lambda *a: pytest.fail("timed without autotune"))
    for _ in range(2):
        choice = compile_choice("auto", tiny_llama, new_cache, MIN_STEPS, serving=False)
        reason = "auto on the CPU: the fused C decode layers run eager"
        assert choice == {"compile": False, "reason": reason}


def test_a_cache_that_cannot_compile_keeps_eager_with_the_reason(tiny_llama, new_cache):
    def eager_only(static=False):
        if static:
            raise RuntimeError("no static layout")
        return new_cache(static=False)

    choice = compile_choice("auto", tiny_llama, eager_only, MIN_STEPS, False, autotune=True)
    reason = "compiling failed: RuntimeError: no static layout"
    assert choice == {"compile": False, "reason": reason}


@pytest.mark.slow
def test_autotune_times_both_and_keeps_nothing(tiny_llama, new_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    first = compile_choice("auto", tiny_llama, new_cache, MIN_STEPS, False, autotune=True)
    assert set(first["itl_ms"]) == {"eager", "compiled"}
    faster = first["itl_ms"]["compiled"] < 0.97 * first["itl_ms"]["eager"]
    assert first["compile"] == faster and "autotune:" in first["reason"]
    assert not any(tmp_path.iterdir())  # nothing persisted


@pytest.mark.slow
def test_more_compiled_engines_than_torchs_default_limit_all_compile(tiny_llama):
    """torch keeps 8 graphs per code object and runs the rest eagerly, silently; a sweep
    or a benchmark builds more compiled engines than that in one process."""
    import torch._dynamo.utils as dynamo_utils

    from kvlab.engine import Engine, GenerationConfig

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    cfg = GenerationConfig(2, stop_on_eos=False)
    for rows in range(1, 11):  # ten batch shapes: ten graphs of Decoder.logits
        engine = Engine(tiny_llama, new_cache_of(tiny_llama)(static=True), compile=True)
        engine.generate([list(range(3, 9))] * rows, cfg)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 10


def test_nearby_lengths_share_one_compiled_graph(tiny_llama):
    """A static cache rounds its rows up to STATIC_ROOM_STEP tokens, so a warm-up and the run
    after it (or a sweep's points) of other lengths reuse the graph instead of compiling
    once per length (a compile inside a measured run is counted in its decode time)."""
    import torch._dynamo.utils as dynamo_utils

    from kvlab.cache.composed import STATIC_ROOM_STEP
    from kvlab.engine import Engine, GenerationConfig

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    engine = Engine(tiny_llama, new_cache_of(tiny_llama)(static=True), compile=True)
    for prompt_len, new in ((6, 2), (30, 9), (STATIC_ROOM_STEP - 12, 12)):
        engine.generate([list(range(3, 3 + prompt_len))], GenerationConfig(new, stop_on_eos=False))
    assert engine.cache.store.slots == STATIC_ROOM_STEP
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1


def new_cache_of(model):
    return cache_factory("full", model, {})


@pytest.mark.slow
def test_a_compiled_engine_speculates_like_plain_eager_greedy(tiny_llama):
    """engine.compile=auto can now meet spec=ngram: verification steps run eagerly beside
    compiled decode steps, over a static cache that rolls back; the text must not change."""
    from kvlab.engine import Engine, GenerationConfig
    from kvlab.speculative.config import SpecConfig

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: prompt lookup drafts and is checked
    ngram = SpecConfig("ngram", num_speculative_tokens=3, max_ngram=3, min_ngram=1)
    plain = Engine(tiny_llama, new_cache_of(tiny_llama)(static=False))
    want = plain.generate([prompt], GenerationConfig(24, stop_on_eos=False)).tokens
    compiled = Engine(tiny_llama, new_cache_of(tiny_llama)(static=True), compile=True)
    run = compiled.generate([prompt], GenerationConfig(24, stop_on_eos=False, spec=ngram))
    assert run.tokens == want
