"""Serving traces (seeded arrivals, lengths, shared prefix) and serving metrics against
values computed by hand on a fake clock."""

from __future__ import annotations

import math
import statistics

import pytest

from kvlab.serving import LengthDistribution, RequestTimes, TraceConfig, make_trace, serving_metrics

CORPUS = list(range(100_000))  # token ids = positions: which window a prompt took is visible


def test_trace_is_seeded_and_offline_traces_arrive_at_once():
    cfg = TraceConfig(num_requests=8, prompt_len=LengthDistribution("uniform", low=4, high=9))
    assert make_trace(cfg, CORPUS) == make_trace(cfg, CORPUS)
    assert make_trace(cfg, CORPUS) != make_trace(TraceConfig(**{**cfg.__dict__, "seed": 1}), CORPUS)
    assert all(r.arrival_s == 0.0 for r in make_trace(cfg, CORPUS))


def test_the_same_requests_arrive_at_any_rate():
    """A rate sweep compares one workload: only the arrival times change with the rate."""
    lengths = dict(prompt_len=LengthDistribution("longtail", 64, 8, 512, 0.8))
    traces = [make_trace(TraceConfig(12, rate, **lengths), CORPUS) for rate in (0, 0.5, 4)]
    for trace in traces[1:]:
        assert [(r.prompt, r.max_new_tokens) for r in trace] == [
            (r.prompt, r.max_new_tokens) for r in traces[0]
        ]
    assert traces[1][-1].arrival_s > traces[2][-1].arrival_s > 0


def test_poisson_arrivals_have_the_rate_asked_for():
    trace = make_trace(TraceConfig(num_requests=4000, rate=2.0, seed=3), CORPUS * 6)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)  # 1 / rate
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.08)  # exponential: sd = mean


def test_prompts_are_disjoint_windows_after_the_shared_prefix():
    cfg = TraceConfig(
        num_requests=5, shared_prefix=7, prompt_len=LengthDistribution("uniform", low=3, high=6)
    )
    trace = make_trace(cfg, CORPUS)
    own = [r.prompt[7:] for r in trace]
    assert all(r.prompt[:7] == tuple(range(7)) for r in trace)
    assert all(3 <= len(p) <= 6 for p in own)
    flat = [t for p in own for t in p]
    assert flat == list(range(7, 7 + len(flat)))  # consecutive, never reused


def test_long_tail_lengths_have_their_median_and_stay_in_range():
    dist = LengthDistribution("longtail", value=200, low=16, high=2048, sigma=0.8)
    cfg = TraceConfig(num_requests=3000, output_len=dist, seed=5)
    outputs = [r.max_new_tokens for r in make_trace(cfg, CORPUS * 70)]
    assert min(outputs) >= 16 and max(outputs) <= 2048
    assert statistics.median(outputs) == pytest.approx(200, rel=0.06)
    assert statistics.mean(outputs) > 1.2 * statistics.median(outputs)  # a right tail


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: LengthDistribution("zipf"), "kind"),
        (lambda: LengthDistribution("uniform", low=9, high=3), "low"),
        (lambda: LengthDistribution("longtail", value=10, sigma=0), "sigma"),
        (lambda: TraceConfig(num_requests=0), "num_requests"),
        (lambda: TraceConfig(rate=-1), "rate"),
        (lambda: make_trace(TraceConfig(num_requests=4), list(range(100))), "corpus"),
    ],
)
def test_bad_trace_settings_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_metrics_equal_hand_computed_values_on_a_fake_clock():
    # request a: arrives 0, admitted 0, tokens at 1, 2, 4; request b: arrives 1, admitted 2,
    # tokens at 3, 5 (a and b run together from 2 to 4)
    a = RequestTimes(0.0, 0.0, [1.0, 2.0, 4.0])
    b = RequestTimes(1.0, 2.0, [3.0, 5.0])
    m = serving_metrics([a, b])
    assert m["duration_s"] == 5.0
    assert m["request_throughput"] == pytest.approx(2 / 5)
    assert m["output_throughput"] == pytest.approx(5 / 5)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * (1 + 2) / 2)
    assert m["median_tpot_ms"] == pytest.approx(1000 * (1.5 + 2.0) / 2)  # (4-1)/2, (5-3)/1
    assert m["mean_itl_ms"] == pytest.approx(1000 * (1 + 2 + 2) / 3)
    assert m["p99_ttft_ms"] == pytest.approx(1000 * (1 + 0.99 * 1))  # [1, 2]: rank 0.99
    assert m["median_itl_ms"] == pytest.approx(2000)  # [1, 2, 2]
    assert m["median_e2el_ms"] == pytest.approx(1000 * (4 + 4) / 2)
    assert m["max_concurrency"] == 2
    assert m["mean_concurrency"] == pytest.approx((1 * 2 + 2 * 2 + 1 * 1) / 5)


def test_tokens_delivered_together_count_one_gap_in_itl_and_each_in_tpot():
    """A speculative step emits several tokens at one time: ITL is per delivery (vLLM's
    streamed chunk), TPOT per token."""
    m = serving_metrics([RequestTimes(0.0, 0.0, [1.0, 3.0, 3.0, 3.0, 4.0])])
    assert m["mean_itl_ms"] == pytest.approx(1000 * (2 + 1) / 2)
    assert m["mean_tpot_ms"] == pytest.approx(1000 * 3 / 4)


def test_one_token_outputs_have_no_tpot_and_unfinished_requests_are_refused():
    m = serving_metrics([RequestTimes(0.0, None, [0.5])])
    assert math.isnan(m["mean_tpot_ms"]) and m["mean_ttft_ms"] == 500
    with pytest.raises(ValueError, match="finished"):
        serving_metrics([RequestTimes(0.0)])
