"""The ``compressed`` strategy (DeepSeek-V4's CSA/HCA on ordinary models): exactness at ratio
1, bulk prefill = chunked = token-by-token emission for every gate, the pooling against a
hand computation, the memory report, and the calibrated compressor's fit, save and refusal."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, cache_factory
from kvlab.cache.base import strategy
from kvlab.cache.pooled.calibration import calibrate, save
from kvlab.cache.pooled.pooling import GATES
from kvlab.models.rope import RotaryTables

LOSSY = dict(csa_ratio=2, hca_ratio=4, window=3, sinks=1, top_k=2, observe=2)


def run_logits(model, cache, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits (T, V) of every position of ``ids`` fed in pieces of ``chunk`` tokens."""
    cache.allocate(1, len(ids))
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start : start + chunk]])
            positions = torch.arange(start, start + piece.shape[1])[None]
            out.append(model(piece, positions, cache)[0])
    return torch.cat(out)


def random_ids(model, length: int, seed: int = 5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()


def with_random_gates(cache):
    """Give every layer a random calibrated gate (no file): exercises the per-channel path."""
    gen = torch.Generator().manual_seed(0)
    dim = cache.spec.head_dim
    for pool in cache.policy.pools.values():
        pool.gate = "calibrated"
        pool.proj = torch.randn(dim, 2 * dim, generator=gen) * 0.3
        pool.bias = torch.randn(pool.span, 2 * dim, generator=gen)
    return cache


def test_ratio_one_uniform_no_top_k_is_exactly_full(tiny_llama):
    ids = random_ids(tiny_llama, 23)
    options = dict(schedule=["csa"], csa_ratio=1, overlap=False, top_k=0, window=0, sinks=0)
    spec = tiny_llama.cache_spec()
    full = run_logits(tiny_llama, build_cache("full", spec), ids, 23)
    for chunk in (23, 5, 1):
        compressed = run_logits(tiny_llama, build_cache("compressed", spec, options), ids, chunk)
        torch.testing.assert_close(compressed, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize(("overlap", "in_window"), [(True, True), (False, True), (True, False)])
def test_bulk_prefill_equals_chunks_and_decode_emission(tiny_llama, gate, overlap, in_window):
    """Prefill pools every closed window at once; decode pools each as its last token arrives;
    both give the same attention output (so the same logits) at every position."""
    ids = random_ids(tiny_llama, 29)
    spec = tiny_llama.cache_spec()
    gate_option = "uniform" if gate == "calibrated" else gate
    options = LOSSY | dict(gate=gate_option, overlap=overlap, in_window=in_window)

    def cache():
        built = build_cache("compressed", spec, options)
        return with_random_gates(built) if gate == "calibrated" else built

    bulk = run_logits(tiny_llama, cache(), ids, 29)
    for chunk in (1, 3, 8):
        torch.testing.assert_close(
            run_logits(tiny_llama, cache(), ids, chunk), bulk, atol=2e-5, rtol=0
        )


@pytest.mark.parametrize("gate", ["uniform", "attention"])
@pytest.mark.parametrize("in_window", [True, False])
def test_a_decode_plan_from_the_host_equals_the_tensor_plan(tiny_llama, gate, in_window):
    """A decode step's pooling fields and per-head tables, worked out on the host, are the
    tensors the tensor-op plan gives (``plan_pooling`` with a mask asked for; the window's
    ``per_head_index``; the top-k bounds from ``seen``): rows holding nothing, inside the
    first window, closing one, past the ring, and a padding row with no token."""
    from kvlab.cache.base import StepInfo
    from kvlab.cache.pooled.plan import plan_pooling
    from kvlab.kernels.attention import per_head_index

    cache = build_cache(
        "compressed", tiny_llama.cache_spec(), LOSSY | dict(gate=gate, in_window=in_window)
    )
    cache.allocate(7, 64)
    policy, heads = cache.policy, cache.spec.num_kv_heads
    lengths, num_new = [0, 1, 3, 7, 8, 23, 17], [1, 1, 1, 1, 1, 1, 0]
    info = StepInfo(torch.tensor(lengths)[:, None], num_new, rope=None)
    step = policy.plan(info, lengths, cache.store, static=False)
    behind, bounds = policy.options.entries_behind(), (step.start, step.end)
    assert step.top_k and step.window_heads is not None
    for key, pooled in policy.geometries.items():
        host = plan_pooling(info, lengths, bounds, pooled.pool, None, behind, True)
        tensors = plan_pooling(info, lengths, bounds, pooled.pool, pooled.slots, behind, True)
        assert host.pools == tensors.pools and host.visible is None
        for name in ("buffer_slots", "seen", "query_slots", "windows", "closes", "slots"):
            found, expected = getattr(host, name), getattr(tensors, name)
            assert (
                (found is None)
                == (expected is None)
                == (name == "query_slots" and gate != "attention")
            )
            if found is not None:
                assert found.dtype == expected.dtype and torch.equal(found, expected), name
        assert torch.equal(step.plans[key].seen, tensors.seen)
        if key in step.top_k:
            index, top_k = step.top_k[key], pooled.pool.top_k
            pairs = torch.arange(len(lengths) * heads)[:, None]
            assert torch.equal(index.base, pairs * pooled.slots)
            assert torch.equal(index.hi, tensors.seen.clamp(max=top_k).repeat_interleave(heads))
            assert torch.equal(index.lo, torch.zeros(len(lengths) * heads, dtype=torch.int64))
            assert index.table.shape == (len(lengths) * heads, top_k)
    window = step.window_step
    expected = per_head_index(window.where.rows, window.origin, window.filled, heads)
    for found, wanted in zip(step.window_heads, expected, strict=True):
        assert found.dtype == wanted.dtype and torch.equal(found, wanted)


def test_lossy_settings_differ_from_full(tiny_llama):
    ids = random_ids(tiny_llama, 29)
    spec = tiny_llama.cache_spec()
    full = run_logits(tiny_llama, build_cache("full", spec), ids, 29)
    compressed = run_logits(tiny_llama, build_cache("compressed", spec, LOSSY), ids, 29)
    assert (compressed[:1] - full[:1]).abs().max() < 1e-5  # no window closed yet: exact
    assert (compressed[10:] - full[10:]).abs().max() > 1e-3
    dense = run_logits(tiny_llama, build_cache("compressed", spec, LOSSY | dict(top_k=0)), ids, 29)
    assert (dense[:5] - compressed[:5]).abs().max() < 1e-5  # at most 2 CSA entries visible
    assert (dense[8:] - compressed[8:]).abs().max() > 1e-3  # top-2 of 4+ entries selects


def test_uniform_entries_are_window_means_rotated_at_the_window_start(tiny_llama):
    """CSA (overlap: the previous window's tokens too) and HCA by hand, from the raw keys
    and values each layer handed to the cache."""
    ids = random_ids(tiny_llama, 17)
    options = dict(schedule=["csa", "hca"], csa_ratio=2, hca_ratio=4, window=3, sinks=0, top_k=0)
    cache = build_cache("compressed", tiny_llama.cache_spec(), options)
    seen, attend = {}, cache.attend

    def recording_attend(step, layer, q, k, v, k_raw):
        seen[layer] = (k_raw, v)
        return attend(step, layer, q, k, v, k_raw)

    cache.attend = recording_attend
    run_logits(tiny_llama, cache, ids, 17)
    for layer, (ratio, span) in {0: (2, 4), 1: (4, 4)}.items():
        k_raw, v = seen[layer]  # (1, H_kv, T, D)
        for w in range(17 // ratio):
            tokens = slice(max(0, (w + 1) * ratio - span), (w + 1) * ratio)
            rope = RotaryTables(tiny_llama.inv_freq, torch.tensor([[w * ratio]]), torch.float32)
            key = rope.rotate_heads_first(k_raw[:, :, tokens].mean(dim=2, keepdim=True))
            keys, values = cache.policy.layers[layer].read(17 // ratio)
            torch.testing.assert_close(keys[0, :, w], key[0, :, 0], atol=1e-5, rtol=0)
            value = v[0, :, tokens].mean(dim=1)
            torch.testing.assert_close(values[0, :, w], value, atol=1e-5, rtol=0)


def test_memory_report_counts_entries_buffer_and_window(tiny_llama):
    spec = tiny_llama.cache_spec()
    options = dict(csa_ratio=4, hca_ratio=16, window=8, sinks=2, gate="attention", observe=2)
    cache = build_cache("compressed", spec, options)
    run_logits(tiny_llama, cache, random_ids(tiny_llama, 128), 128)
    report = cache.memory()
    assert set(report.details) == {"window", "entries", "buffer", "queries"}
    assert sum(report.details.values()) == report.held_bytes
    # by hand (one row, fp32): layer 0 is CSA (ratio 4, span 8), layer 1 HCA (ratio 16,
    # span 16); every store has one trash slot that padding and non-closing rows write into
    head = spec.num_kv_heads * spec.head_dim * 4  # bytes of one K or V row
    assert report.details["entries"] == 2 * head * ((128 // 4 + 1) + (128 // 16 + 1))
    assert report.details["buffer"] == 2 * head * ((8 + 1) + (16 + 1))
    q_row = spec.num_heads * spec.head_dim * 4
    assert report.details["queries"] == q_row * ((2 + 1) + (2 + 1))  # observe=2 queries
    window_slots = 2 + 8 + 1  # sinks + window + trash, K and V per layer, int64 positions
    assert report.details["window"] == 2 * 2 * head * window_slots + 8 * window_slots
    planned = type(cache).planned_bytes(spec, cache.options, 1, 128)
    assert sum(planned.values()) == report.held_bytes
    full = build_cache("full", spec)
    run_logits(tiny_llama, full, random_ids(tiny_llama, 128), 128)
    assert report.used_bytes < full.memory().used_bytes / 2


@pytest.mark.parametrize("sequential", [False, True])
def test_calibrated_compressor_fits_saves_and_refuses_other_models(
    tiny_llama, tiny_checkpoints, tmp_path, sequential
):
    from kvlab import load_model

    options_dict = dict(LOSSY, calibration=dict(steps=40, lr=0.05, sequential=sequential))
    options = build_cache("compressed", tiny_llama.cache_spec(), options_dict).options
    windows = [random_ids(tiny_llama, 48, seed) for seed in range(2)]
    fitted = calibrate(tiny_llama, options, windows, strategy("compressed"))
    errors = fitted["report"]["relative_error"]
    assert set(errors) == {"0", "1"}
    for layer in errors.values():
        assert layer["calibrated"] < layer["uniform"]
    save(tmp_path, fitted, tiny_llama.fingerprint(), options)

    calibrated = dict(options_dict, gate="calibrated", compressor=str(tmp_path))
    cache = cache_factory("compressed", tiny_llama, calibrated)()
    assert all(pool.proj is not None for pool in cache.policy.pools.values())
    run_logits(tiny_llama, cache, windows[0], 48)

    other, _ = load_model(str(tiny_checkpoints["qwen2"]))
    with pytest.raises(ValueError, match="was fitted to model"):
        cache_factory("compressed", other, calibrated)()


def test_fingerprint_ignores_dtype_but_not_weights(tiny_llama, tiny_checkpoints):
    from kvlab import load_model

    bf16, _ = load_model(str(tiny_checkpoints["llama"]), torch.bfloat16)
    other, _ = load_model(str(tiny_checkpoints["smollm"]))
    assert bf16.fingerprint() == tiny_llama.fingerprint() != other.fingerprint()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(gate="magic"), "gate"),
        (dict(schedule=["csa", "mla"]), "schedule"),
        (dict(window=0), "window"),
        (dict(top_k=-1), "top_k"),
        (dict(calibration=dict(steps=0)), "calibration.steps"),
    ],
)
def test_bad_options_name_the_field(tiny_llama, options, field):
    with pytest.raises(ValueError, match=f"cache.options.{field}="):
        build_cache("compressed", tiny_llama.cache_spec(), options)


def test_entries_become_visible_when_closed_or_when_out_of_the_window():
    from kvlab.cache.pooled.pooling import visible_entries

    positions = torch.arange(12)[None]
    closed = visible_entries(positions, 3, ratio=4)[0, 0]  # (T, N)
    assert closed.sum(dim=1).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    behind = visible_entries(positions, 3, ratio=4, behind=3)[0, 0]  # window of 3 tokens
    # entry 0 pools tokens 0-3: out of query t's window (t-2..t) from t = 6 on
    assert behind.sum(dim=1).tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_sequential_calibration_records_inputs_through_the_fitted_layers(tiny_llama):
    from kvlab.cache.pooled.calibration import record

    ids = random_ids(tiny_llama, 24)
    student = build_cache("compressed", tiny_llama.cache_spec(), LOSSY)
    student.policy.pools = {
        0: student.policy.pools[0]
    }  # layer 0 compresses, layer 1 is still exact
    teacher, taught = record(tiny_llama, ids), record(tiny_llama, ids, student)
    for a, b in zip(teacher[0], taught[0], strict=True):
        torch.testing.assert_close(a, b)  # layer 0 gets the same inputs
    assert (teacher[1][0] - taught[1][0]).abs().max() > 1e-3  # layer 1 sees compression


def test_every_option_calibration_depends_on_keys_the_cached_compressor(tiny_llama):
    """A compressor fitted with one option value is never reused for another (a new option
    must be listed here: fitted, or in NOT_FITTED)."""
    from dataclasses import fields

    from kvlab.cache.pooled.calibration import NOT_FITTED, default_dir

    spec = tiny_llama.cache_spec()
    other = dict(schedule=["hca"], csa_ratio=3, hca_ratio=8, window=5, sinks=0, top_k=3)
    other |= dict(overlap=False, proportional=True, in_window=False, calibration=dict(steps=7))
    other |= dict(kv_group_size=8, kv_tensor_scale=0.5)  # the codec: the student runs in it
    unfitted = dict(gate="keynorm", observe=3, compressor="/elsewhere")
    options_type = type(build_cache("compressed", spec, LOSSY).options)
    assert {f.name for f in fields(options_type)} == set(other) | set(unfitted) | {
        "kv_bits",
        "kv_format",
        "rotate",  # the codec's rotation: refused with pooled entries (only "none" runs)
    }
    assert set(unfitted) == set(NOT_FITTED)
    base = default_dir("m", build_cache("compressed", spec, LOSSY).options)
    for name, value in (other | unfitted).items():
        moved = default_dir("m", build_cache("compressed", spec, LOSSY | {name: value}).options)
        assert (moved == base) == (name in NOT_FITTED), name
    coded = [LOSSY | {"kv_group_size": 8, "kv_bits": bits} for bits in (0, 8)]
    coded.append(coded[1] | {"kv_format": "e4m3"})  # kv_bits and kv_format move it too
    dirs = {default_dir("m", build_cache("compressed", spec, o).options) for o in coded}
    assert len(dirs) == 3


def test_compressor_cache_key_covers_the_calibration_text(tiny_llama, tmp_path):
    from kvlab.cache.pooled.calibration import default_dir, recipe

    text = tmp_path / "calibration.txt"
    text.write_text("first text\n")
    options = build_cache(
        "compressed", tiny_llama.cache_spec(), LOSSY | {"calibration": {"source": str(text)}}
    ).options
    before = default_dir("m", options)
    text.write_text("second text\n")
    assert default_dir("m", options) != before
    assert recipe(options)["calibration_text"]
