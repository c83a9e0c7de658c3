"""The fp4 KV codecs (``kv_format=mxfp4|nvfp4`` at ``kv_bits=4``): e2m1 codes two a byte
with a scale byte per block, by the OCP MX v1.0 rule (blocks of 32, an e8m0 power-of-two
scale) and NVIDIA's NVFP4 (blocks of 16, an e4m3 scale under a per-tensor scale): values on
the grid round-trip exactly, others within the format's bound, and decode through the
stored parts equals attention over dequantized rows on every store."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.codecs import Fp4Codec
from kvlab.cache.codecs.fp4 import E2M1

GEN = torch.Generator().manual_seed(7)


def blocks(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, group))


@pytest.mark.parametrize("variant", ["mxfp4", "nvfp4"])
def test_values_on_the_grid_round_trip_exactly(variant):
    codec = Fp4Codec(variant, 64)
    grid = torch.cat((E2M1, -E2M1))[torch.randint(0, 16, (5, 64), generator=GEN)]
    exponents = torch.randint(-6, 6, (5, 64 // codec.group, 1), generator=GEN).float()
    x = blocks(grid, codec.group) * torch.exp2(exponents)
    x[..., 0] = 6 * torch.exp2(exponents[..., 0])  # each block's maximum on the grid's top
    x = x.flatten(-2)
    assert torch.equal(codec.decode(codec.encode(x), torch.float32), x)


@pytest.mark.parametrize(("variant", "bound"), [("mxfp4", 1 / 4), ("nvfp4", 1 / 6 * 17 / 16)])
def test_round_trip_error_is_within_the_format_bound(variant, bound):
    """MX: the shared exponent floor(log2 amax) - 2 can put a block's maximum up to 8 steps
    high, clipped to 6: at most amax / 4 off. NVFP4: the scale amax / 6 rounds to e4m3
    (2^-4 relative) and an element to its nearest e2m1 value (half a step: one scale
    unit), so at most amax / 6 * 17 / 16 off (scales in e4m3's normal range)."""
    codec = Fp4Codec(variant, 64)
    x = torch.randn(4, 3, 40, 64, generator=GEN) * torch.logspace(-1, 1.5, 64)
    back = codec.decode(codec.encode(x), torch.float32)
    group_max = blocks(x, codec.group).abs().amax(-1, keepdim=True)
    error = blocks((back - x).abs(), codec.group)
    assert (error <= group_max * bound * (1 + 1e-6)).all()
    assert torch.equal(codec.decode(codec.encode(back), torch.float32), back)  # idempotent
    assert (back != x).any()


@pytest.mark.parametrize(
    ("variant", "tensor_scale"), [("mxfp4", 1.0), ("nvfp4", 1.0), ("nvfp4", 0.5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_encoder_writes_the_torch_encodings_bytes(variant, tensor_scale, dtype):
    """The CPU write path (codes.c) against the torch encoding, bit for bit: rows over eight
    decades, a zero block, block maxima at and just below powers of two (the MX exponent's
    edges) and values halfway between two e2m1 magnitudes (ties go to the smaller)."""
    from kvlab.kernels.build import library

    if library() is None:
        pytest.skip("no C compiler for the kernels")
    codec = Fp4Codec(variant, 64, tensor_scale=tensor_scale)
    x = torch.randn(4, 3, 40, 64, generator=GEN) * torch.logspace(-6, 2, 64)
    x[0, 0, 0, :32] = 0.0
    edges = (
        torch.tensor([1.0, 2.0, 4.0, 0.5]) * torch.tensor([1.0, 1 - 2**-24, 1 + 2**-23])[:, None]
    )
    x[0, 1, : edges.numel(), 0] = edges.flatten()
    ties = (E2M1[1:] + E2M1[:-1]) / 2
    x[1, 0, :, :31] = ties[torch.randint(0, len(ties), (40, 31), generator=GEN)]
    x[1, 0, :, 31] = 6.0  # the block's maximum: scale 1 (MX: 2^(2 - 2)), so ties stay ties
    x = x.to(dtype)
    c_codes, c_scales = codec.encode(x)
    t_codes, t_scales = codec.encode_torch(x)
    assert torch.equal(c_scales, t_scales) and torch.equal(c_codes, t_codes)


def test_bytes_per_token_are_half_a_byte_a_channel_and_a_scale_byte_a_block():
    assert Fp4Codec("mxfp4", 64).bytes_per_token(64, torch.float32) == 32 + 2
    assert Fp4Codec("nvfp4", 64).bytes_per_token(64, torch.bfloat16) == 32 + 4


def test_the_tensor_scale_extends_nvfp4_to_small_magnitudes():
    """Blocks whose amax / 6 lies below e4m3's smallest normal lose precision (subnormal
    scales); a per-tensor scale brings them back into range."""
    x = torch.randn(8, 64, generator=GEN) * 1e-3
    plain, scaled = Fp4Codec("nvfp4", 64), Fp4Codec("nvfp4", 64, tensor_scale=2.0**-10)
    errors = [(c.decode(c.encode(x), torch.float32) - x).abs().mean() for c in (plain, scaled)]
    assert errors[1] < errors[0] / 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_bits=8, kv_format="nvfp4", kv_group_size=16), "4-bit format but kv_bits=8"),
        (dict(kv_bits=4, kv_format="nvfp4"), "kv_group_size=32 with kv_format=nvfp4, which"),
        (dict(kv_bits=4, kv_format="mxfp4", kv_group_size=32), "head_dim=16 is not a multiple"),
        (dict(kv_bits=4, kv_format="nvfp4", kv_group_size=16, kv_tensor_scale=0),
         "kv_tensor_scale=0 is invalid"),
    ],
)  # fmt: skip
def test_bad_fp4_options_name_the_field(options, message, tiny_llama):
    with pytest.raises(ValueError, match=message):
        build_cache("full", tiny_llama.cache_spec(), options)


NVFP4 = dict(kv_bits=4, kv_format="nvfp4", kv_group_size=16)


@pytest.mark.parametrize(
    ("name", "options"),
    [("full", NVFP4), ("paged", dict(block_size=4, **NVFP4)),
     ("sliding", dict(sinks=2, window=6, **NVFP4))],
)  # fmt: skip
def test_decode_over_fp4_codes_equals_attention_over_the_decoded_rows(name, options, tiny_llama):
    """A decode step (the kernel's table lookups over the stored bytes) and the first
    token of a two-token step (rows decoded by the codec in torch) see the same keys and
    values: equal logits."""
    vocab, spec = tiny_llama.config.vocab_size, tiny_llama.cache_spec()
    prompt = torch.randint(0, vocab, (1, 13), generator=GEN)
    after = torch.randint(0, vocab, (1, 2), generator=GEN)
    logits = []
    with torch.inference_mode():
        for width in (1, 2):
            cache = build_cache(name, spec, options)
            cache.allocate(1, 16)
            tiny_llama(prompt, torch.arange(13)[None], cache)
            step = tiny_llama(after[:, :width], torch.arange(13, 13 + width)[None], cache)
            logits.append(step[:, 0])
    assert (logits[0] - logits[1]).abs().max() <= 1e-5
    assert not torch.equal(logits[0], logits[0].round())  # real logits, not a constant
