"""How kvlab's one-row kernels walk a weight (``rows`` one after another, or ``tiles`` of
four side by side) changes speed only: both orders give the float64 product up to fp32
summation order, for every pair of weight (fp32, bf16, int8 codes) and row precisions; the
order is the layer's own (its kernel plan's), passed to every call, never a global."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import load_model
from kvlab.kernels import kernel_available
from kvlab.kernels.linear import GEMV_ORDERS, _small_linear_impl, in_order, int8_linear
from kvlab.kernels.plan import KernelSettings, make_plan

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (*DTYPES, torch.int8)


@pytest.mark.parametrize("order", GEMV_ORDERS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("in_features", [200, 576])
@pytest.mark.parametrize("bias", [False, True])
def test_either_one_row_kernel_order_gives_the_product(
    order, weight_dtype, x_dtype, in_features, bias
):
    """One row against 99 weight rows (tiles of 4 and 3 left over), channels with a tail
    past the vectors (200 = 128 + 64 + 8) or without (576), bf16 rows with vdpbf16ps where
    weights and rows are both bf16, int8 codes with a bf16 scale per output; the output in
    the row's dtype."""
    torch.manual_seed(0)
    b = torch.randn(99).to(x_dtype) if bias else None
    x = torch.randn(1, in_features).to(x_dtype)
    if weight_dtype == torch.int8:
        codes = torch.randint(-127, 128, (99, in_features), dtype=torch.int8)
        scale = (torch.rand(99) / 64).bfloat16()
        weight = codes.double() * scale.double()[:, None]
        out = int8_linear(x, codes, scale, b, order)
    else:
        weight = torch.randn(99, in_features).to(weight_dtype)
        out = _small_linear_impl(x, weight, b, in_order(order))
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    tolerance = 1e-5 if x_dtype == torch.float32 else 1.6e-2  # bf16 output rounding
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_bad_order_fails_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="'columns'.*allowed: tiles, rows"):
        in_order("columns")
    with pytest.raises(ValueError, match="engine.gemv_order='columns'.*auto, tiles, rows"):
        KernelSettings(gemv_order="columns")


@pytest.mark.parametrize("order", GEMV_ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_model_walks_the_order_its_plan_names(tiny_checkpoints, dtype, order):
    """Where kvlab's kernel runs a model's linears, each walks its weight in the order the
    model's plan names (the default ``rows``, or the one asked for), with the product."""
    from kvlab.kernels.linear import DecodeLinear

    plan = make_plan(KernelSettings(gemv_order=order))
    model, _ = load_model(str(tiny_checkpoints["smollm"]), dtype, plan=plan)
    linears = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert linears and {m.in_order for m in linears} == {in_order(order)}
    assert make_plan().weights(dtype).order == "rows"
    linear = linears[0]
    x = torch.randn(1, 1, linear.in_features).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(linear(x).float(), F.linear(x, linear.weight, linear.bias).float(),
                               rtol=tolerance, atol=tolerance)  # fmt: skip


def test_int8_weights_walk_the_order_their_plan_names():
    from torch import nn

    from kvlab.kernels.plan import LinearKernels
    from kvlab.quant.rtn import Int8Linear

    torch.manual_seed(0)
    linear, x = nn.Linear(200, 99), torch.randn(1, 200)
    outs = []
    for order in GEMV_ORDERS:
        layer = Int8Linear(linear, kernels=LinearKernels("kvlab", "kvlab", order=order))
        assert layer.order == order
        outs.append(layer(x))
    torch.testing.assert_close(*outs, rtol=1e-2, atol=1e-2)  # bf16 outputs, two sum orders
