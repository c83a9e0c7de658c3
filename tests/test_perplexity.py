"""``eval=ppl``: GPTQ-protocol windows, equal perplexity for one pass, chunks and every
exact strategy, lossy caches seen only through chunks, and transformers as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.eval import eval_options, run_evals
from kvlab.eval.perplexity import PerplexityOptions, windows

TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs." for i in range(60))


class CharTokenizer:
    """A stand-in tokenizer for the tiny random model: one id per byte (vocab 256)."""

    def __call__(self, text, return_tensors=None):
        ids = list(text.encode())
        return _Encoded(torch.tensor([ids]) if return_tensors == "pt" else ids)


class _Encoded(dict):
    def __init__(self, ids):
        super().__init__(input_ids=ids)
        self.input_ids = ids


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def ppl(model, name, options, text_file, **eval_opts):
    evals = {"ppl": dict(dataset=text_file, seqlen=64, **eval_opts)}
    new_cache = lambda: build_cache(name, model.cache_spec(), options)  # noqa: E731
    return run_evals(model, CharTokenizer(), new_cache, evals)


def test_windows_follow_the_gptq_protocol(text_file):
    rows = TEXT.splitlines(keepends=True)
    joined = len("\n\n".join(rows).encode())
    data = windows(CharTokenizer(), PerplexityOptions(dataset=text_file, seqlen=64))
    assert data.shape == (joined // 64, 64)  # the tail is dropped


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("full", {}),
        ("paged", dict(block_size=5)),
        ("sliding", dict(window=64)),
        ("gqa_shared", dict(factor=1)),
        ("int4", dict(group_size=4, residual=64)),
    ],
)
def test_exact_strategies_give_single_pass_perplexity(name, options, tiny_llama, text_file):
    single = ppl(tiny_llama, "full", {}, text_file)["corpus/ppl"]
    chunked = ppl(tiny_llama, name, options, text_file, chunk=9)
    assert math.isclose(chunked["corpus/ppl"], single, rel_tol=1e-5)
    assert "corpus/note" not in chunked


def test_lossy_cache_acts_only_through_chunks(tiny_llama, text_file):
    lossy = dict(group_size=4, residual=0)
    single = ppl(tiny_llama, "full", {}, text_file)["corpus/ppl"]
    one_pass = ppl(tiny_llama, "int2", lossy, text_file)
    assert math.isclose(one_pass["corpus/ppl"], single, rel_tol=1e-6)
    assert "cannot change perplexity" in one_pass["corpus/note"]
    assert ppl(tiny_llama, "int2", lossy, text_file, chunk=8)["corpus/ppl"] != single


def test_nocache_scores_each_window_in_one_pass(tiny_llama, text_file):
    metrics = ppl(tiny_llama, "nocache", {}, text_file, chunk=8)
    assert metrics["corpus/chunk"] == 64
    assert math.isclose(
        metrics["corpus/ppl"], ppl(tiny_llama, "full", {}, text_file)["corpus/ppl"], rel_tol=1e-5
    )


@pytest.mark.parametrize(("field", "value"), [("seqlen", 0), ("chunk", -1), ("max_windows", -2)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"eval.ppl.{field}={value}"):
        eval_options("ppl", {field: value})


def test_unknown_eval_lists_known():
    with pytest.raises(ValueError, match="known: .*ppl"):
        eval_options("nope", {})


@pytest.mark.slow
def test_default_model_perplexity_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from kvlab.models import resolve_checkpoint

    model, tokenizer = smollm2
    options = dict(seqlen=512, max_windows=2)
    new_cache = lambda: build_cache("full", model.cache_spec())  # noqa: E731
    ours = run_evals(model, tokenizer, new_cache, {"ppl": options})["wikitext2/ppl"]
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint("smollm2-135m"), dtype=torch.float32
    ).eval()
    data = windows(tokenizer, PerplexityOptions(**options))
    with torch.inference_mode():
        losses = [hf(w[None], labels=w[None]).loss.item() for w in data]  # mean over T-1
    assert math.isclose(ours, math.exp(sum(losses) / len(losses)), rel_tol=1e-4)
