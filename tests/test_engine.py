"""Engine behaviour: sampling, stopping, streaming, batching and its configuration checks."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig, SamplingConfig, sample


def engine(model) -> Engine:
    return Engine(model, build_cache("full", model.cache_spec()), eos_ids=[7])


PROMPT = [5, 9, 12, 44, 3, 17, 8]


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_llama):
    def run(seed):
        cfg = GenerationConfig(16, SamplingConfig(temperature=1.0, top_p=0.9, seed=seed), False)
        return engine(tiny_llama).generate([PROMPT], cfg).tokens[0]

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)])
def test_tight_filters_reduce_to_greedy(tiny_llama, filters):
    greedy = engine(tiny_llama).generate([PROMPT], GenerationConfig(10, stop_on_eos=False))
    cfg = GenerationConfig(10, SamplingConfig(temperature=0.7, seed=0, **filters), False)
    assert engine(tiny_llama).generate([PROMPT], cfg).tokens == greedy.tokens


def test_top_k_keeps_only_k_candidates():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingConfig(1.0, top_k=2), gen).item() for _ in range(200)}
    assert picks == {1, 2}


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingConfig(1.0, top_p=0.7), gen).item() for _ in range(300)}
    assert picks == {0, 1}


def test_stops_at_eos(tiny_llama):
    greedy = (
        engine(tiny_llama).generate([PROMPT], GenerationConfig(12, stop_on_eos=False)).tokens[0]
    )
    eos = greedy[3]
    stopped = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()), eos_ids=[eos])
    tokens = stopped.generate([PROMPT], GenerationConfig(12)).tokens[0]
    assert tokens == greedy[: greedy.index(eos) + 1]


def test_stream_yields_each_token_as_it_comes(tiny_llama):
    run = engine(tiny_llama).stream([PROMPT, PROMPT[:3]], GenerationConfig(5, stop_on_eos=False))
    steps = list(run)
    assert len(steps) == 5
    assert [step[0] for step in steps] == run.tokens[0]
    assert [step[1] for step in steps] == run.tokens[1]
    assert len(run.stats.step_s) == 4 and run.stats.ttft_s > 0


def test_finished_sequences_leave_the_batch(tiny_llama):
    first = engine(tiny_llama).generate([PROMPT], GenerationConfig(6, stop_on_eos=False)).tokens[0]
    eos = first[1]
    eng = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()), eos_ids=[eos])
    other = [40, 41, 42, 43]
    run = eng.generate([PROMPT, other], GenerationConfig(6))
    assert run.tokens[0] == first[:2]
    assert run.stats.step_rows[0] == 2 and run.stats.step_rows[-1] == 1
    assert run.tokens[1] == eng.generate([other], GenerationConfig(6)).tokens[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(max_new_tokens=0), "max_new_tokens"), (dict(prefill_chunk=-1), "prefill_chunk")],
)
def test_generation_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_sampling_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_empty_prompt_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="non-empty"):
        engine(tiny_llama).generate([[]], GenerationConfig(2))


def test_the_logits_hook_sees_every_sampled_distribution(tiny_llama):
    """``on_logits`` receives the logits each token was sampled from (greedy: its argmax),
    with the prompt index of each row."""
    seen: list[tuple[torch.Tensor, list[int]]] = []
    engine = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()))
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    cfg = GenerationConfig(4, stop_on_eos=False)
    run = engine.generate(prompts, cfg, on_logits=lambda logits, rows: seen.append((logits, rows)))
    assert len(seen) == 4 and all(rows == [0, 1] for _, rows in seen)
    for index, tokens in enumerate(run.tokens):
        assert tokens == [int(logits[index].argmax()) for logits, _ in seen]
