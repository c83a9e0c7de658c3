"""``eval=kld``: KL divergence to the exact reference's next-token distributions past the
first chunk, and top-1 agreement — zero for exact strategies, growing as codes get
narrower, equal to a hand computation with torch's kl_div."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.eval import eval_options, run_evals
from kvlab.eval.kld import window_divergence
from tests.test_perplexity import CharTokenizer
from tests.test_perplexity import text_file as text_file  # the corpus fixture, shared


def kld(model, name, options, path, **eval_opts):
    evals = {"kld": dict(dataset=path, seqlen=64, max_windows=3, chunk=16, **eval_opts)}
    new_cache = lambda: build_cache(name, model.cache_spec(), options)  # noqa: E731
    return run_evals(model, CharTokenizer(), new_cache, evals)


@pytest.mark.parametrize(("name", "options"), [("full", {}), ("paged", dict(block_size=5))])
def test_an_exact_strategy_moves_no_distribution(name, options, tiny_llama, text_file):
    metrics = kld(tiny_llama, name, options, text_file)
    assert metrics["corpus/kld"] <= 1e-9 and metrics["corpus/top1_agreement"] == 1.0
    assert abs(metrics["corpus/delta_nll"]) <= 1e-9
    assert metrics["corpus/kld_positions"] == 3 * (64 - 16 - 1)


def test_narrower_codes_move_the_distributions_further(tiny_llama, text_file):
    got = [
        kld(tiny_llama, "full", dict(kv_bits=bits, kv_group_size=16), text_file)["corpus/kld"]
        for bits in (8, 4, 2)
    ]
    assert 0 < got[0] < got[1] < got[2]


def test_the_divergence_is_torchs_kl_div_of_the_chunked_logits(tiny_llama):
    window = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    lossy = dict(kv_bits=2, kv_group_size=16)
    spec = tiny_llama.cache_spec()
    caches = (build_cache("full", spec), build_cache("full", spec, lossy))
    got = window_divergence(tiny_llama, window, caches, 8)  # (31, 3)
    logits = []
    for cache in (build_cache("full", spec), build_cache("full", spec, lossy)):
        cache.allocate(1, 40)
        with torch.inference_mode():
            pieces = [
                tiny_llama(window[None, s : s + 8], torch.arange(s, s + 8)[None], cache)[0]
                for s in range(0, 40, 8)
            ]
        logits.append(torch.cat(pieces)[8:39].log_softmax(-1))
    reference, strategy = logits
    want = torch.nn.functional.kl_div(strategy, reference, log_target=True, reduction="none")
    torch.testing.assert_close(got[:, 0], want.sum(-1), atol=1e-6, rtol=1e-5)
    assert got[:, 1].tolist() == (reference.argmax(-1) == strategy.argmax(-1)).float().tolist()
    targets = window[9:40, None]  # position t predicts token t + 1
    nll_gap = reference.gather(-1, targets) - strategy.gather(-1, targets)
    torch.testing.assert_close(got[:, 2], nll_gap[:, 0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(chunk=64, seqlen=64), "eval.kld.chunk=64 is invalid; allowed: 1 <= chunk < seqlen"),
        (dict(seqlen=0), "eval.kld.seqlen=0 is invalid"),
        (dict(reference="bogus"), "'bogus' is not a registered strategy"),
    ],
)
def test_bad_options_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        eval_options("kld", fields)
