"""The kernel plan is decided the same way every run: from the CPU's capability (probed, no
timing) and fixed defaults, never by vendor; a named kernel applies where it can; timing
happens only with autotune, in the process, recorded in the plan and never persisted."""

from __future__ import annotations

import pytest
import torch

from kvlab.kernels import autotune
from kvlab.kernels.plan import (
    KernelSettings,
    LinearKernels,
    capability,
    default_plan,
    make_plan,
)

AVX512 = {"isa": "AVX512", "c_kernels": True, "onednn_bf16_reorder": True,
          "onednn_matmul_float32": True, "onednn_matmul_bfloat16": True}  # fmt: skip
AVX2_NO_COMPILER = {"isa": "AVX2", "c_kernels": False, "onednn_bf16_reorder": False,
                    "onednn_matmul_float32": True, "onednn_matmul_bfloat16": False}  # fmt: skip
NO_ONEDNN = {"isa": "DEFAULT", "c_kernels": True, "onednn_bf16_reorder": False,
             "onednn_matmul_float32": False, "onednn_matmul_bfloat16": False}  # fmt: skip


@pytest.fixture
def no_timing(monkeypatch):
    """Any timing fails the test."""
    monkeypatch.setattr(autotune, "time_passes", lambda *a, **k: pytest.fail("a kernel was timed"))


@pytest.mark.parametrize(
    ("cap", "decode", "fp32_wide", "bf16_wide"),
    [(AVX512, "kvlab", "onednn", "packed"), (AVX2_NO_COMPILER, "plain", "onednn", "plain"),
     (NO_ONEDNN, "kvlab", "plain", "plain")],
)  # fmt: skip
def test_defaults_follow_what_the_cpu_can_do(no_timing, cap, decode, fp32_wide, bf16_wide):
    plan = make_plan(cap=cap)
    for name in ("float32", "bfloat16", "int8", "int4"):
        kernels = plan.weights(name)
        assert (kernels.one_row, kernels.few_rows, kernels.order) == (decode, decode, "rows")
    assert plan.weights(torch.float32).wide == fp32_wide
    assert plan.weights(torch.bfloat16).wide == bf16_wide
    assert plan.weights(torch.int8).wide == "plain"
    assert plan.capability == cap and plan.timings == {}


def test_named_kernels_apply_where_they_can_else_plain(no_timing):
    plan = make_plan(KernelSettings("onednn", "onednn", "tiles"), cap=AVX512)
    assert plan.weights(torch.bfloat16) == LinearKernels("onednn", "onednn", "onednn", "tiles")
    assert plan.weights(torch.float32) == LinearKernels("plain", "plain", "onednn", "tiles")
    assert plan.weights(torch.int8).wide == "onednn"  # the widened codes in fp32
    assert plan.weights("int4").wide == "plain"  # dequantized into one product: no choice
    kvlab = make_plan(KernelSettings(linear="kvlab"), cap=AVX2_NO_COMPILER)
    assert kvlab.weights(torch.float32).one_row == "plain"  # no C kernels here


def test_the_default_plan_is_this_machines_and_records_whole(no_timing):
    plan = default_plan()
    assert plan == make_plan() and plan.capability == capability()
    record = plan.record()
    assert set(record) == {"linear", "capability", "settings", "timings", "prefill_attention"}
    assert record["linear"]["float32"] == {
        "one_row": plan.weights(torch.float32).one_row,
        "few_rows": plan.weights(torch.float32).few_rows,
        "wide": plan.weights(torch.float32).wide,
        "order": "rows",
    }
    assert record["settings"]["autotune"] is False and record["timings"] == {}


def test_autotune_times_in_the_process_and_persists_nothing(tmp_path, monkeypatch):
    """A timing under load can favour another kernel: with autotune it decides that run
    (kvlab's kernel unless another is FUSED_MARGIN faster, plain unless MARGIN), the timings
    are in the plan, nothing is written, and the next autotune times again."""
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    rounds = iter([{"plain": 5.0, "kvlab": 14.0}, {"plain": 9.0, "kvlab": 7.0}])
    decode = next(rounds)
    monkeypatch.setattr(autotune, "time_decode", lambda name, kernels, rows: {
        k: decode[k] if k in decode else 99.0 for k in kernels})  # fmt: skip
    monkeypatch.setattr(autotune, "time_wide", lambda name, kernels: {
        k: 10.0 if k == "plain" else 9.7 for k in kernels})  # fmt: skip
    monkeypatch.setattr(autotune, "time_orders", lambda name: {"tiles": 8.0, "rows": 10.0})
    settings = KernelSettings(autotune=True)
    first = make_plan(settings, cap=AVX512)
    assert first.weights(torch.float32).one_row == "plain"  # 64% apart, under that load
    assert first.weights(torch.float32).wide == "plain"  # 3% faster: under MARGIN
    assert first.timings["float32/one_row"] == {"plain": 5.0, "kvlab": 14.0}
    assert first.record()["timings"] == first.timings
    decode = next(rounds)
    again = make_plan(settings, cap=AVX512)
    assert again.weights(torch.float32).one_row == "kvlab"  # plain not FUSED_MARGIN faster
    assert again.weights(torch.float32).order == "tiles"  # 20% faster than rows
    assert not any(tmp_path.iterdir())
    fixed = make_plan(KernelSettings(linear="kvlab", autotune=True), cap=AVX512)
    assert "float32/one_row" not in fixed.timings  # a named kernel is not timed


def test_a_bad_setting_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="engine.linear='fast' is invalid; allowed: auto"):
        KernelSettings(linear="fast")
    with pytest.raises(ValueError, match="engine.autotune='yes'.*true, false"):
        KernelSettings(autotune="yes")
