"""The lm-eval adapter: per-item log-likelihoods equal lm-eval's own ``hf`` backend on the
same converted weights (HellaSwag, LAMBADA, WikiText), scoring with the cache in the loop
equals one causal pass for exact strategies, generate_until honours its stop strings, and
``eval=lm_eval`` runs inside a kvlab run."""

from __future__ import annotations

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

import kvlab.lm_eval_model  # noqa: E402, F401  (registers lm-eval's model kvlab)
from kvlab.cache import build_cache  # noqa: E402
from kvlab.eval.harness import TASKS_DIR, task_metrics  # noqa: E402
from kvlab.eval.lm_eval_adapter import KvlabLM, batch_limits  # noqa: E402
from kvlab.eval.scoring import continuation_logprobs, length_batches, scored_batches  # noqa: E402
from kvlab.models.loading import resolve_checkpoint  # noqa: E402


def _evaluate(model: str, model_args: str, task: str, limit: int) -> dict:
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], limit=limit, batch_size=8,
        device="cpu", log_samples=True, task_manager=TaskManager(include_path=str(TASKS_DIR)),
    )  # fmt: skip


def _loglikelihoods(result: dict, task: str) -> list[float]:
    values = [resp[0] for sample in result["samples"][task] for resp in sample["resps"]]
    return [v[0] if isinstance(v, list | tuple) else v for v in values]  # rolling: a float


def _compare_with_hf(task: str, limit: int, metrics: tuple[str, ...]) -> None:
    ours = _evaluate("kvlab", "model=smollm2-135m,cache=full,quant=none,dtype=float32", task, limit)
    checkpoint = resolve_checkpoint("smollm2-135m")
    theirs = _evaluate("hf", f"pretrained={checkpoint},dtype=float32", task, limit)
    for metric in metrics:
        assert ours["results"][task][metric] == theirs["results"][task][metric], metric
    a, b = _loglikelihoods(ours, task), _loglikelihoods(theirs, task)
    assert len(a) == len(b) > 0
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3


@pytest.mark.slow
def test_hellaswag_first_16_items_match_the_hf_backend():
    _compare_with_hf("hellaswag_local", 16, ("acc,none", "acc_norm,none"))  # 64 scores


def test_lambada_and_wikitext_match_the_hf_backend():
    _compare_with_hf("lambada_openai_local", 8, ("acc,none",))
    _compare_with_hf("wikitext_local", 1, ())


def _pairs(vocab: int, rows: int = 5):
    g = torch.Generator().manual_seed(0)
    lengths = [(3, 4), (11, 1), (7, 6), (1, 2), (9, 3)][:rows]
    contexts = [torch.randint(0, vocab, (c,), generator=g).tolist() for c, _ in lengths]
    continuations = [torch.randint(0, vocab, (x,), generator=g).tolist() for _, x in lengths]
    return contexts, continuations


@pytest.mark.parametrize(("strategy", "chunk"), [("full", 0), ("full", 4), ("paged", 3)])
def test_scoring_through_an_exact_cache_equals_one_causal_pass(tiny_llama, strategy, chunk):
    contexts, continuations = _pairs(tiny_llama.config.vocab_size)
    spec = tiny_llama.cache_spec()
    one_pass = continuation_logprobs(
        tiny_llama, build_cache("nocache", spec), contexts, continuations
    )
    cached = continuation_logprobs(
        tiny_llama, build_cache(strategy, spec), contexts, continuations, chunk
    )
    for (a, greedy_a), (b, greedy_b) in zip(one_pass, cached, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


SHARING = [("full", {}), ("int4", dict(residual=0, group_size=4)), ("paged", dict(block_size=3))]


@pytest.mark.parametrize(("strategy", "options"), SHARING)
@pytest.mark.parametrize(("batch_size", "max_tokens"), [(1, 0), (2, 0), (8, 12)])
def test_pairs_that_share_a_context_score_as_each_pair_alone(
    tiny_llama, strategy, options, batch_size, max_tokens
):
    """One prefill per distinct context, its continuations on copies of its rows (paged:
    re-prefilled per pair): the same scores as each pair scored by itself."""
    contexts, continuations = _pairs(tiny_llama.config.vocab_size)
    contexts = [contexts[0], contexts[2], contexts[0], contexts[2], contexts[4]]
    spec = tiny_llama.cache_spec()
    new_cache = lambda: build_cache(strategy, spec, options)  # noqa: E731
    alone = [
        continuation_logprobs(tiny_llama, new_cache(), [c], [x])[0]
        for c, x in zip(contexts, continuations, strict=True)
    ]
    got: dict[int, tuple[float, bool]] = {}
    for batch, scores in scored_batches(
        tiny_llama, new_cache, contexts, continuations, batch_size, max_tokens=max_tokens
    ):
        assert len(batch) <= batch_size
        got |= dict(zip(batch, scores, strict=True))
    assert sorted(got) == list(range(len(contexts)))
    for i, (logprob, greedy) in enumerate(alone):
        assert got[i][0] == pytest.approx(logprob, abs=1e-4) and got[i][1] == greedy


def test_length_batches_cut_at_rows_and_padded_tokens():
    lengths = [9, 8, 5, 5, 4, 1]
    assert list(length_batches(lengths, int, 4)) == [[9, 8, 5, 5], [4, 1]]
    assert list(length_batches(lengths, int, 4, max_tokens=16)) == [[9], [8, 5], [5, 4, 1]]
    assert list(length_batches([20, 3], int, 4, max_tokens=16)) == [[20], [3]]


def test_batch_size_auto_and_bad_values():
    assert batch_limits(8) == (8, 0) and batch_limits("3") == (3, 0)
    assert batch_limits("auto")[0] == 32 and batch_limits("auto:4", 16)[0] == 16
    assert batch_limits("auto")[1] > 0
    with pytest.raises(ValueError, match="batch_size='x' is invalid; allowed: a positive"):
        batch_limits("x")
    with pytest.raises(ValueError, match="batch_size=0"):
        batch_limits(0)


def test_marked_positions_are_the_full_logits_at_those_positions(tiny_llama):
    ids = torch.tensor(_pairs(tiny_llama.config.vocab_size)[0][2][:6]).expand(2, 6)
    positions = torch.arange(6).expand(2, 6)
    marked = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    with torch.inference_mode():
        whole = tiny_llama(ids, positions, build_cache("nocache", tiny_llama.cache_spec()))
        picked = tiny_llama(ids, positions, build_cache("nocache", tiny_llama.cache_spec()),
                            logit_index=marked)  # fmt: skip
    assert torch.allclose(picked, whole[marked], atol=1e-6)


def test_scoring_with_a_lossy_cache_puts_it_in_the_loop(tiny_llama):
    contexts, continuations = _pairs(tiny_llama.config.vocab_size)
    spec = tiny_llama.cache_spec()
    exact = continuation_logprobs(tiny_llama, build_cache("full", spec), contexts, continuations)
    lossy = continuation_logprobs(
        tiny_llama,
        build_cache("int4", spec, {"residual": 0, "group_size": 4}),
        contexts,
        continuations,
    )
    assert any(abs(a - b) > 1e-3 for (a, _), (b, _) in zip(exact, lossy, strict=True))


class _Request:
    def __init__(self, *args):
        self.args = args


def test_generate_until_stops_at_the_stop_string(smollm2):
    model, tokenizer = smollm2
    lm = KvlabLM.from_loaded(model, tokenizer, lambda: build_cache("full", model.cache_spec()))
    prompt = "The capital of France is Paris. The capital of Italy is"
    (free,) = lm.generate_until([_Request(prompt, {"until": ["<never>"], "max_gen_toks": 12})])
    assert len(tokenizer.encode(free, add_special_tokens=False)) <= 12
    stop = free.strip().split()[1]  # a word the greedy continuation produces
    (cut,) = lm.generate_until([_Request(prompt, {"until": [stop], "max_gen_toks": 12})])
    assert stop not in cut and free.startswith(cut)


def test_task_metrics_are_named_task_slash_metric():
    results = {
        "hellaswag_local": {"acc,none": 0.5, "acc_norm,none": 0.6, "sample_len": 10, "alias": "x"}
    }
    assert task_metrics(results) == {
        "hellaswag/acc": 0.5, "hellaswag/acc_norm": 0.6, "hellaswag/items": 10,
    }  # fmt: skip


@pytest.mark.slow
def test_eval_lm_eval_runs_inside_a_kvlab_run(tmp_path):
    from kvlab.config import RunConfig, WorkloadConfig
    from kvlab.run import run_point

    options = {"tasks": ["lambada_openai_local"], "limit": 4, "batch_size": 4}
    cfg = RunConfig(workload=WorkloadConfig(prompt_len=16, new_tokens=2), eval={"lm_eval": options})
    record = run_point(cfg, tmp_path)
    assert record["status"] == "ok", record.get("traceback")
    assert record["metrics"]["lambada_openai/items"] == 4
    assert 0 <= record["metrics"]["lambada_openai/acc"] <= 1
    assert (tmp_path / "lm_eval_results.json").exists()


class _RecordingHook:
    def __init__(self):
        self.entries = []

    def add_partial(self, kind, key, value):
        self.entries.append((kind, key))


def test_rolling_windows_are_not_cached_as_loglikelihood_entries(smollm2):
    """lm-eval's ``--use_cache`` must see one ``loglikelihood_rolling`` entry per text, never
    its windows as ``loglikelihood`` entries keyed (text, "") (the hf backend keys them None)."""
    model, tokenizer = smollm2
    lm = KvlabLM.from_loaded(
        model, tokenizer, lambda: build_cache("full", model.cache_spec()), max_length=16
    )
    lm.cache_hook = _RecordingHook()
    text = "The tower is 324 metres tall, about the same height as an 81-storey building."
    (total,) = lm.loglikelihood_rolling([_Request(text)], disable_tqdm=True)
    assert total < 0
    assert lm.cache_hook.entries == [("loglikelihood_rolling", (text,))]


def test_truncated_pairs_feed_at_most_max_length_positions(smollm2):
    """The hf backend feeds (context + continuation)[-(max_length + 1):][:-1]: max_length
    positions, never max_length + 1; and its log-likelihood equals one causal pass."""
    model, tokenizer = smollm2
    spec = model.cache_spec()
    fed = []

    class Recording(type(build_cache("full", spec))):
        def plan(self, info):
            fed.append(int(info.positions.max()) + 1)
            return super().plan(info)

    lm = KvlabLM.from_loaded(model, tokenizer, lambda: Recording(spec), max_length=12)
    context, continuation = list(range(100, 130)), [7, 8, 9, 10]
    ((logprob, _),) = lm._loglikelihood_tokens([(("c", "x"), context, continuation)], True)
    assert max(fed) == 12
    window = (context + continuation)[-13:]  # what the hf backend scores
    ((expected, _),) = continuation_logprobs(
        model, build_cache("nocache", spec), [window[:-4]], [window[-4:]]
    )
    assert logprob == pytest.approx(expected, abs=1e-4)


def test_generation_longer_than_max_length_is_refused(smollm2):
    model, tokenizer = smollm2
    lm = KvlabLM.from_loaded(
        model, tokenizer, lambda: build_cache("full", model.cache_spec()), max_length=16
    )
    with pytest.raises(ValueError, match="max_gen_toks=16 must be less than max_length=16"):
        lm.generate_until([_Request("Hello", {"until": ["\n"], "max_gen_toks": 16})])
