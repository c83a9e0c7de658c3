"""How kvlab's one-row kernels walk a weight (``rows`` one after another, or ``tiles`` of
four side by side) changes speed only: both orders give the float64 product up to fp32
summation order, for every pair of weight (fp32, bf16, int8 codes) and row precisions; the
order is timed per weight dtype, kept at ``rows`` unless ``tiles`` is a margin faster,
cached, set in the loaded kernels and recorded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import load_model
from kvlab.kernels import kernel_available
from kvlab.kernels.linear import (
    GEMV_ORDERS,
    _small_linear_impl,
    gemv_order,
    int8_linear,
    set_gemv_order,
)
from kvlab.models import gemv_order as order_choice
from kvlab.models.gemv_order import apply_chosen_orders, one_row_order

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (*DTYPES, torch.int8)


@pytest.fixture
def kept_orders():
    """The kernels' orders as they were before the test, restored after it."""
    before = {dtype: gemv_order(dtype) for dtype in WEIGHT_DTYPES}
    yield
    for dtype, order in before.items():
        set_gemv_order(dtype, order)


@pytest.mark.parametrize("order", GEMV_ORDERS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("in_features", [200, 576])
@pytest.mark.parametrize("bias", [False, True])
def test_either_one_row_kernel_order_gives_the_product(
    kept_orders, order, weight_dtype, x_dtype, in_features, bias
):
    """One row against 99 weight rows (tiles of 4 and 3 left over), channels with a tail
    past the vectors (200 = 128 + 64 + 8) or without (576), bf16 rows with vdpbf16ps where
    weights and rows are both bf16, int8 codes with a bf16 scale per output; the output in
    the row's dtype."""
    torch.manual_seed(0)
    b = torch.randn(99).to(x_dtype) if bias else None
    x = torch.randn(1, in_features).to(x_dtype)
    set_gemv_order(weight_dtype, order)
    assert gemv_order(weight_dtype) == order
    if weight_dtype == torch.int8:
        codes = torch.randint(-127, 128, (99, in_features), dtype=torch.int8)
        scale = (torch.rand(99) / 64).bfloat16()
        weight = codes.double() * scale.double()[:, None]
        out = int8_linear(x, codes, scale, b)
    else:
        weight = torch.randn(99, in_features).to(weight_dtype)
        out = _small_linear_impl(x, weight, b)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    tolerance = 1e-5 if x_dtype == torch.float32 else 1.6e-2  # bf16 output rounding
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_tiles_replace_rows_only_where_a_margin_faster_timed_on_three_loads(
    kept_orders, tmp_path, monkeypatch
):
    """The first load's timing decides for now; the next two time again, keep each order's
    best and decide again; later loads read the choice without timing."""
    timings = iter([{"tiles": 9.7, "rows": 10.0}, {"tiles": 8.0, "rows": 11.0},
                    {"tiles": 9.0, "rows": 9.9}, {"tiles": 10.0, "rows": 9.0}])  # fmt: skip
    calls = []
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("KVLAB_CPU_GEMV_ORDER", raising=False)
    monkeypatch.setattr(order_choice, "_time_orders", lambda d: calls.append(d) or next(timings))

    def load(dtype: torch.dtype) -> dict:
        one_row_order.cache_clear()
        return one_row_order(dtype)

    try:
        first = load(torch.float32)  # 3% apart: the rows stay
        assert first == {"order": "rows", "decode_ms": {"tiles": 9.7, "rows": 10.0},
                         "timings": 1}  # fmt: skip
        assert gemv_order(torch.float32) == "rows"
        second = load(torch.float32)  # the best of both timings: 20% apart
        assert second["decode_ms"] == {"tiles": 8.0, "rows": 10.0} and second["timings"] == 2
        assert second["order"] == "tiles" and gemv_order(torch.float32) == "tiles"
        assert load(torch.float32)["timings"] == 3
        assert load(torch.float32)["order"] == "tiles"  # read back, not timed again
        assert load(torch.bfloat16)["order"] == "rows"  # each dtype its own choice
        assert calls == [torch.float32] * 3 + [torch.bfloat16]
        set_gemv_order(torch.float32, "rows")  # another build of the kernels is loaded
        apply_chosen_orders()
        assert gemv_order(torch.float32) == "tiles"
    finally:
        one_row_order.cache_clear()


def test_a_forced_order_is_set_and_a_bad_name_fails(kept_orders, monkeypatch):
    monkeypatch.setenv("KVLAB_CPU_GEMV_ORDER", "rows")
    one_row_order.cache_clear()
    try:
        assert one_row_order(torch.float32) == {"order": "rows", "decode_ms": {}, "forced": True}
        assert gemv_order(torch.float32) == "rows"
        monkeypatch.setenv("KVLAB_CPU_GEMV_ORDER", "columns")
        one_row_order.cache_clear()
        with pytest.raises(ValueError, match="KVLAB_CPU_GEMV_ORDER='columns'.*tiles, rows"):
            one_row_order(torch.float32)
        with pytest.raises(ValueError, match="'columns'.*allowed: tiles, rows"):
            set_gemv_order(torch.float32, "columns")
    finally:
        one_row_order.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_model_runs_the_order_its_kernel_chose(tiny_checkpoints, dtype):
    """Where kvlab's kernel runs a model's linears, the kernels walk its weights in the
    order chosen for its dtype, and result.json records that choice."""
    from kvlab.kernels.linear import DecodeLinear
    from kvlab.tracking import environment

    model, _ = load_model(str(tiny_checkpoints["smollm"]), dtype)
    if not any(isinstance(m, DecodeLinear) for m in model.modules()):
        pytest.skip("this CPU runs the model's linears with another kernel")
    choice = one_row_order(dtype)
    assert gemv_order(dtype) == choice["order"]
    if not choice.get("forced"):
        assert set(choice["decode_ms"]) == set(GEMV_ORDERS)
    recorded = environment()["cpu_kernels"]["gemv_order"]
    assert recorded[str(dtype).removeprefix("torch.")] == choice
    linear = next(m for m in model.modules() if isinstance(m, DecodeLinear))
    x = torch.randn(1, 1, linear.in_features).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(linear(x).float(), F.linear(x, linear.weight, linear.bias).float(),
                               rtol=tolerance, atol=tolerance)  # fmt: skip


def test_int8_weights_run_the_order_their_kernel_chose():
    from kvlab.models.cpu_kernels import int8_kernel

    if "kvlab" not in int8_kernel()["applicable"]:
        pytest.skip("kvlab's int8 kernel does not apply here")
    assert gemv_order(torch.int8) == one_row_order(torch.int8)["order"]
