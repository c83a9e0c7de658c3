"""The fp8 KV codec (``kv_format=e4m3|e5m2`` at ``kv_bits=8``): its rounding against the
formats' precision, its options, and its error against ``full`` next to the integer codes
at the same and at half the bits."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.codecs import Fp8Codec
from kvlab.engine import Engine

GEN = torch.Generator().manual_seed(5)


@pytest.mark.parametrize(("variant", "mantissa"), [("e4m3", 3), ("e5m2", 2)])
def test_round_trip_error_is_within_half_a_step_of_the_group_maximum(variant, mantissa):
    """A group's largest magnitude maps to the format's largest value; every element then
    rounds to the nearest representable one, at most half a step (2^-mantissa of its
    binade, so 2^-(mantissa + 1) of the group maximum) away."""
    codec = Fp8Codec(variant, 16, 64)
    x = torch.randn(4, 3, 50, 64, generator=GEN) * torch.logspace(-3, 2, 64)
    back = codec.decode(codec.encode(x), torch.float32)
    group_max = x.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
    error = (back - x).abs().unflatten(-1, (-1, 16))
    assert (error <= group_max * 2.0 ** -(mantissa + 1) * (1 + 1e-6)).all()
    assert torch.equal(codec.decode(codec.encode(back), torch.float32), back)  # idempotent
    assert (back != x).any()  # it does quantize


@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_encoder_writes_torchs_bytes_and_scales(variant, dtype):
    """The CPU write path (codes.c) against the torch encoding, bit for bit: random rows over
    eight decades (subnormal codes included), exact zeros, a group of one value repeated,
    and values halfway between two codes (round to nearest even)."""
    pytest.importorskip("kvlab.kernels.codes")
    from kvlab.kernels.build import library

    if library() is None:
        pytest.skip("no C compiler for the kernels")
    codec = Fp8Codec(variant, 16, 64)
    x = torch.randn(5, 3, 40, 64, generator=GEN) * torch.logspace(-6, 2, 64)
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 0.3
    grid = codec.table[codec.table.isfinite() & (codec.table.abs() <= codec.largest)]
    between = (grid.sort().values[:-1] + grid.sort().values[1:]) / 2  # ties
    x[1, 0, :, :16] = between[torch.randint(0, len(between), (40, 16), generator=GEN)]
    x[1, 0, :, 15] = codec.largest  # so the group's scale is 1 and the ties stay ties
    x = x.to(dtype)
    c_codes, c_scale = codec.encode(x)
    t_codes, t_scale = codec.encode_torch(x)
    assert c_scale.dtype == t_scale.dtype == dtype
    assert torch.equal(c_scale, t_scale) and torch.equal(c_codes, t_codes)


def test_zero_rows_and_bytes_per_token():
    codec = Fp8Codec("e4m3", 32, 64)
    zeros = torch.zeros(2, 64)
    assert torch.equal(codec.decode(codec.encode(zeros), torch.float32), zeros)
    assert codec.bytes_per_token(64, torch.bfloat16) == 64 + 2 * 2  # bytes + two bf16 scales


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_bits=4, kv_format="e4m3"), "8-bit format but kv_bits=4"),
        (dict(kv_bits=8, kv_format="fp4"), "kv_format='fp4' is invalid; allowed"),
    ],
)
def test_bad_formats_name_the_field(options, message, tiny_llama):
    with pytest.raises(ValueError, match=message):
        build_cache("full", tiny_llama.cache_spec(), options)


def logit_error(model, options, prompt, tokens) -> float:
    """Mean |logits - full's| over decode steps that feed the same ``tokens``."""
    runs = []
    for opts in ({}, options):
        engine = Engine(model, build_cache("full", model.cache_spec(), opts))
        engine.cache.allocate(1, len(prompt) + len(tokens))
        seq, rows = list(prompt), []
        engine.prefill([seq], len(seq))
        for token in tokens:
            seq.append(token)
            rows.append(engine.decode_step([seq]))
        runs.append(torch.cat(rows))
    return (runs[1] - runs[0]).abs().mean().item()


def test_fp8_error_lies_between_int8_and_int4_codes(smollm2):
    """On the default model: e4m3 (3 mantissa bits, a scale per 32 channels) is coarser
    than int8 codes and finer than int4 codes of the same groups, and e5m2 coarser than
    e4m3."""
    model, _ = smollm2
    prompt = torch.randint(0, 49000, (96,), generator=GEN).tolist()
    tokens = torch.randint(0, 49000, (12,), generator=GEN).tolist()
    error = {
        name: logit_error(model, dict(kv_bits=bits, kv_format=fmt), prompt, tokens)
        for name, bits, fmt in [("int8", 8, "int"), ("e4m3", 8, "e4m3"),
                                ("e5m2", 8, "e5m2"), ("int4", 4, "int")]
    }  # fmt: skip
    assert 0 < error["int8"] < error["e4m3"] < error["e5m2"], error
    assert error["e4m3"] < error["int4"], error
