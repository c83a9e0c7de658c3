"""Speculation with model drafts (``self``, ``layerskip``, ``model``): greedy output equals
plain decoding whatever the draft — the same model (every draft accepted, which proves
the draft cache's catch-up and rollback), the model with int4 weights, its first layer, a
draft over a lossy cache of its own — in batches whose rows finish at different times and
in rounds after a preemption; refusals name the draft's field."""

from __future__ import annotations

import copy

import pytest

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig
from kvlab.quant import quantize_
from kvlab.speculative import SpecConfig
from kvlab.speculative.drafts import ModelDraft, early_exit
from tests.test_speculative import repetitive_prompts

K = 3


def draft_of(model, cache="full", options=None):
    return ModelDraft(model, build_cache(cache, model.cache_spec(), options or {}))


def run(target, prompts, draft=None, method="self", new=12, cache=("full", {}), eos=()):
    name, options = cache
    spec = SpecConfig(method, K, layers=1 if method == "layerskip" else 0)
    engine = Engine(target, build_cache(name, target.cache_spec(), options), eos, draft=draft)
    cfg = GenerationConfig(new, stop_on_eos=bool(eos), spec=spec if draft else SpecConfig())
    return engine.generate(prompts, cfg)


@pytest.fixture
def prompts(tiny_llama):
    ragged = repetitive_prompts(tiny_llama.config.vocab_size)
    return [ragged[0], ragged[1][:6], ragged[2]]


def test_the_model_as_its_own_draft_is_always_accepted(tiny_llama, prompts):
    plain = run(tiny_llama, prompts).tokens
    same = run(tiny_llama, prompts, draft_of(tiny_llama))
    assert same.tokens == plain
    assert same.stats.accepted == same.stats.drafted > 0
    assert max(same.stats.step_tokens) == len(prompts) * (K + 1)


def test_an_int4_draft_and_an_early_exit_keep_the_models_greedy_text(tiny_llama, prompts):
    plain = run(tiny_llama, prompts).tokens
    quantized = copy.deepcopy(tiny_llama)
    assert quantize_(quantized, "rtn", dict(bits=4, group_size=32, symmetric=False)) > 0
    drafts = {"self": draft_of(quantized), "layerskip": draft_of(early_exit(tiny_llama, 1))}
    for method, draft in drafts.items():
        result = run(tiny_llama, prompts, draft, method)
        assert result.tokens == plain, method
        assert 0 <= result.stats.accepted <= result.stats.drafted
        assert result.stats.drafted > 0


def test_a_draft_over_a_lossy_cache_and_a_target_over_paged_blocks(tiny_llama, prompts):
    plain = run(tiny_llama, prompts).tokens
    lossy = draft_of(tiny_llama, "int4", dict(group_size=4, residual=8, rollback=K))
    assert run(tiny_llama, prompts, lossy, cache=("paged", dict(block_size=4))).tokens == plain


def test_a_draft_serves_one_generation_after_another(tiny_llama, prompts):
    """Request indices repeat from one generation to the next: the draft starts afresh."""
    draft = draft_of(tiny_llama)
    for batch, new in (([prompts[1]], 4), (prompts, 12), ([prompts[0]], 9)):
        plain = run(tiny_llama, batch, new=new).tokens
        assert run(tiny_llama, batch, draft, new=new).tokens == plain


def test_rows_that_finish_early_leave_the_draft_too(tiny_llama, prompts):
    first = run(tiny_llama, prompts).tokens[0]
    eos = [first[4]]  # the first prompt stops after five tokens
    plain = run(tiny_llama, prompts, eos=eos).tokens
    draft = draft_of(tiny_llama)
    result = run(tiny_llama, prompts, draft, eos=eos)
    assert result.tokens == plain and len(plain[0]) == 5
    assert result.stats.step_rows[-1] < len(prompts)
    assert draft.cache.lengths == [] or len(draft.rows) == len(draft.cache.lengths)


def test_a_preempted_request_is_drafted_for_again_in_the_next_round(tiny_llama):
    prefix = list(range(3, 13))
    prompts = [prefix, prefix[::-1]]  # 10 tokens each: 3 blocks; 15 at the end: 4
    blocks = ("paged", dict(block_size=4, num_blocks=6, prefix_sharing=False))
    plain = run(tiny_llama, prompts, new=5, cache=("paged", dict(block_size=4))).tokens
    result = run(tiny_llama, prompts, draft_of(tiny_llama), new=5, cache=blocks)
    assert result.stats.preemptions == 1
    assert result.tokens == plain


def test_early_exit_shares_the_weights_and_leaves_the_model_whole(tiny_llama):
    exit_1 = early_exit(tiny_llama, 1)
    assert len(exit_1.layers) == 1 and exit_1.cache_spec().num_layers == 1
    assert len(tiny_llama.layers) == tiny_llama.config.num_layers == 2
    assert exit_1.layers[0] is tiny_llama.layers[0] and exit_1.lm_head is tiny_llama.lm_head
    with pytest.raises(ValueError, match="spec.layers=2 is invalid .* allowed: 1 .. 1"):
        early_exit(tiny_llama, 2)


def test_a_draft_cache_that_cannot_roll_back_is_refused_before_running(tiny_llama, prompts):
    draft = draft_of(tiny_llama, "sliding", dict(sinks=2, window=6))
    with pytest.raises(ValueError, match="and spec.cache=sliding cannot: its ring of 8 slots"):
        run(tiny_llama, prompts, draft)


def test_a_model_method_without_a_draft_says_how_to_give_one(tiny_llama, prompts):
    engine = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()))
    cfg = GenerationConfig(4, spec=SpecConfig("self", K))
    with pytest.raises(ValueError, match="spec.method='self' drafts with a model: build"):
        engine.generate(prompts, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_a_runs_draft_compiles_as_engine_compile_says_and_keeps_the_text(
    tiny_checkpoints, tiny_llama, prompts, compile
):
    """The run's model draft (``build_draft``) takes its own compile choice: compiled, its
    steps run under torch.compile over a static cache and the greedy text is unchanged."""
    from kvlab.config import EngineConfig, ModelConfig, RunConfig
    from kvlab.run import build_draft

    int4 = dict(bits=4, group_size=32, symmetric=False)
    spec = SpecConfig("self", K, quant="rtn", quant_options=int4)
    model = ModelConfig(source=str(tiny_checkpoints["llama"]))
    cfg = RunConfig(model=model, spec=spec, engine=EngineConfig(compile=compile))
    draft = build_draft(cfg, tiny_llama)
    assert draft.compile_choice == {"compile": compile, "reason": f"engine.compile={compile}"}
    assert draft.engine.compiled is compile and draft.cache.static is compile
    assert run(tiny_llama, prompts, draft).tokens == run(tiny_llama, prompts).tokens


def test_the_draft_prefills_beside_the_model_and_catches_up_one_token_in_a_step(
    tiny_llama, prompts
):
    """A new round's prompts reach the draft during the model's prefill (its time counts in
    the prefill's, not in the first decode step's drafting); afterwards a row that lacks only
    its newest token (its drafts were rejected) catches up through a one-token decode step,
    the path a compiled draft runs compiled, and a row that lacks more through a verify."""
    import time

    draft = draft_of(early_exit(tiny_llama, 1))  # rejected often: one-token catch-ups
    calls, spent = [], []
    for name in ("prefill", "decode_step", "verify"):
        method = getattr(draft.engine, name)

        def recorded(*args, method=method, name=name):
            began = time.perf_counter()
            out = method(*args)
            calls.append((name, None))
            spent.append(time.perf_counter() - began) if name == "prefill" else None
            return out

        setattr(draft.engine, name, recorded)
    result = run(tiny_llama, prompts, draft, "layerskip")
    assert result.tokens == run(tiny_llama, prompts).tokens
    assert [name for name, _ in calls].count("prefill") == 1 and calls[0][0] == "prefill"
    assert result.stats.prefill_s[0] >= spent[0]
    catch_ups_by_verify = [name for name, _ in calls].count("verify")
    assert catch_ups_by_verify < len(result.stats.draft_s)  # one per proposal without the path
