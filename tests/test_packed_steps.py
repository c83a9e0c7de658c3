"""Packed steps (kvlab.models.packed): one forward over several caches' parts — a running
batch's decode or verification tokens and prompt chunks of requests in caches of their
own — equals each part's own forward, for every strategy that serves; the scheduler feeds
a step within its token budget, many requests at once, in one forward; a part that does
not fit preempts and the step is planned again with nothing fed twice."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.config import ServingConfig
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.clock import FakeClock
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Request
from kvlab.models.packed import StepPart
from kvlab.serving.server import serve
from tests.test_cache_contract import LOSSY
from tests.test_scheduler import trace

SERVING = sorted(n for n, cls in registered().items() if cls.stores_past and cls.serves)
INT4_PAGED = ("paged", dict(block_size=4, kv_bits=4, kv_group_size=8))


def parts_of(model, name: str, options: dict, seed: int) -> list[StepPart]:
    """A running cache of 3 rows (prompts of 9, 7 and 5 tokens, stored) fed a verification
    step of 1 to 3 tokens a row, and two spawned caches fed padded prompt chunks (a chunk
    after a stored first one, and a first chunk): the same tokens on every call."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def ids(*shape):
        return torch.randint(0, vocab, shape, generator=gen)

    running = build_cache(name, model.cache_spec(), options)
    running.allocate(3, 48)
    with torch.inference_mode():
        model(ids(3, 9), torch.arange(9).expand(3, 9), running, [9, 7, 5])
    chunked = running.spawn() if running.serves else build_cache(name, model.cache_spec(), options)
    chunked.allocate(2, 48)
    with torch.inference_mode():
        model(ids(2, 4), torch.arange(4).expand(2, 4), chunked, [4, 4])
    fresh = build_cache(name, model.cache_spec(), options)
    fresh.allocate(1, 48)
    return [
        StepPart(running, ids(3, 3), torch.tensor([[9], [7], [5]]) + torch.arange(3), [1, 3, 2]),
        StepPart(
            chunked, ids(2, 5), 4 + torch.arange(5).expand(2, 5), [5, 2], torch.tensor([4, 1])
        ),  # fmt: skip
        StepPart(fresh, ids(1, 6), torch.arange(6)[None], [6], torch.tensor([5])),
    ]


def next_logits(model, parts: list[StepPart]) -> list[torch.Tensor]:
    """A decode step of every part's cache after the packed step (what it stored)."""
    out = []
    with torch.inference_mode():
        for p in parts:
            ends = torch.tensor(p.num_new)[:, None] + p.positions[:, :1]
            out.append(model(torch.ones_like(ends), ends, p.cache))
    return out


@pytest.mark.parametrize(
    ("name", "options"),
    [(n, LOSSY[n]) for n in SERVING] + [INT4_PAGED],
    ids=lambda x: str(x),
)
def test_a_packed_step_equals_each_parts_own_forward(name, options, tiny_llama, layers_op_by_op):
    """Logits of every part, padding apart, and what each cache stored, as when each part
    runs alone."""
    alone = parts_of(tiny_llama, name, options, seed=3)
    with torch.inference_mode():
        want = [tiny_llama(p.ids, p.positions, p.cache, p.num_new, p.logit_index) for p in alone]
    packed = parts_of(tiny_llama, name, options, seed=3)
    got = tiny_llama.forward_parts(packed)
    for p, w, g in zip(packed, want, got, strict=True):
        assert g.shape == w.shape
        if p.logit_index is None:  # (B, T, V): the real positions only
            real = torch.arange(p.ids.shape[1]) < torch.tensor(p.num_new)[:, None]
            w, g = w[real], g[real]
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for w, g in zip(next_logits(tiny_llama, alone), next_logits(tiny_llama, packed), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_model_that_does_not_pack_runs_its_parts_in_turn(tiny_checkpoints):
    """transformers' layers (model.backend=hf) take a packed step part by part, planned
    together: the same logits as each part alone."""
    from kvlab import load_model

    model, _ = load_model(str(tiny_checkpoints["qwen3"]), backend="hf")
    alone = parts_of(model, "paged", {"block_size": 4}, seed=4)
    with torch.inference_mode():
        want = [model(p.ids, p.positions, p.cache, p.num_new, p.logit_index) for p in alone]
    got = model.forward_parts(parts_of(model, "paged", {"block_size": 4}, seed=4))
    for w, g, p in zip(want, got, alone, strict=True):
        if p.logit_index is None:
            real = torch.arange(p.ids.shape[1]) < torch.tensor(p.num_new)[:, None]
            w, g = w[real], g[real]
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_steps_feed_many_requests_in_one_forward_within_the_token_budget(tiny_llama, monkeypatch):
    """Eight requests at once, a budget of 24 tokens a step, chunks of 8: each step feeds
    at most 24 tokens, decode tokens included; several requests are fed in one step, next
    to the running batch, in one forward; each request gets what it generates alone."""
    lengths, outputs = (11, 5, 17, 9, 13, 6, 20, 8), (6, 3, 5, 7, 2, 4, 3, 5)
    requests = trace(tiny_llama.config.vocab_size, lengths, outputs, gap=0.0)
    steps, forwards = [], []
    feeds = Scheduler.feeds

    def spy_feeds(sched):
        out = feeds(sched)
        steps.append((len(sched.running), [sum(c) for _, c in out]))
        return out

    forward_parts = type(tiny_llama).forward_parts

    def spy_forward(model, parts):
        forwards.append([p.ids.shape for p in parts])
        return forward_parts(model, parts)

    monkeypatch.setattr(Scheduler, "feeds", spy_feeds)
    monkeypatch.setattr(type(tiny_llama), "forward_parts", spy_forward)
    cfg = ServingConfig(kv_budget_bytes=2**24, chunk=8, max_batched_tokens=24)
    cache = build_cache("paged", tiny_llama.cache_spec(), {"block_size": 4})
    result = serve(tiny_llama, cache, requests, cfg, FakeClock())
    assert all(running + sum(fed) <= 24 for running, fed in steps)
    assert any(len(fed) >= 2 for _, fed in steps)  # several prompts in one step
    assert any(running and fed for running, fed in steps)  # beside the running batch
    assert any(len(shapes) >= 3 for shapes in forwards)  # ... in one forward
    alone = Engine(tiny_llama, build_cache("paged", tiny_llama.cache_spec(), {"block_size": 4}))
    for seq, request in zip(result.seqs, requests, strict=True):
        gen = GenerationConfig(request.max_new_tokens, stop_on_eos=False)
        assert seq.output == alone.generate([list(request.prompt)], gen).tokens[0], seq.index


def test_a_part_that_does_not_fit_preempts_and_the_step_is_planned_again(tiny_llama, monkeypatch):
    """A pool of 10 blocks of 4: request 0 decodes while requests 1 and 2's prompts are
    fed beside it, 2 tokens a step each; when 0 needs a new block after both chunks were
    planned in the same step, the step stops before any layer ran, 2 is preempted and the
    step is planned again (1's chunk placed once, not twice); all get what they generate
    alone."""
    from kvlab.cache.composed import ComposedCache

    options = dict(block_size=4)
    requests = [
        Request(0, 0.0, tuple(range(10, 17)), 14),
        Request(1, 2.5, tuple(range(40, 56)), 6),
        Request(2, 2.5, tuple(range(80, 92)), 6),
    ]
    spawned = build_cache("paged", tiny_llama.cache_spec(), options)
    budget = 11 * spawned.store.block_bytes()  # 10 blocks + the trash block
    planned, failed_after = [0], []
    forward_parts, plan = type(tiny_llama).forward_parts, ComposedCache.plan

    def spy_forward(model, parts):
        planned[0] = 0
        try:
            return forward_parts(model, parts)
        except Exception:
            failed_after.append(planned[0])  # parts planned before the one that did not fit
            raise

    def spy_plan(cache, info):
        step = plan(cache, info)
        planned[0] += 1
        held = [len(tokens) for tokens in cache.store.tokens]  # the token chains it hashes
        assert held == [n + k for n, k in zip(cache.lengths, info.num_new, strict=True)]
        return step

    monkeypatch.setattr(type(tiny_llama), "forward_parts", spy_forward)
    monkeypatch.setattr(ComposedCache, "plan", spy_plan)
    cfg = ServingConfig(kv_budget_bytes=budget, chunk=2)
    cache = build_cache("paged", tiny_llama.cache_spec(), options)
    result = serve(tiny_llama, cache, requests, cfg, FakeClock())
    assert result.preemptions >= 1 and 2 in failed_after
    alone = Engine(tiny_llama, build_cache("paged", tiny_llama.cache_spec(), options))
    for seq, request in zip(result.seqs, requests, strict=True):
        gen = GenerationConfig(request.max_new_tokens, stop_on_eos=False)
        assert seq.output == alone.generate([list(request.prompt)], gen).tokens[0], seq.index
