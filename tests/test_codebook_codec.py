"""The codebook codec (``kvlab/cache/codecs/codebook.py``): codes of 1 to 4 bits packed LSB
first and read back, the C encoder's bytes equal to the torch reference's for both scale
rules and both dtypes, every value the nearest table entry of its scaled channel, NF4 as a
registered ``kv_format``, and what the options refuse."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.codecs import token_formats
from kvlab.cache.codecs.codebook import NF4, CodebookCodec
from kvlab.kernels.attention.segments import pack_bits, unpack_bits
from kvlab.kernels.codes import encode_codebook

GEN = torch.Generator().manual_seed(13)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codes_pack_lsb_first_and_read_back(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=GEN)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits), codes)
    first = int(packed[0, 0, 0])  # code d at bit d * bits
    assert first & ((1 << bits) - 1) == int(codes[0, 0, 0])


@pytest.mark.parametrize("scale", ["absmax", "norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["nf4", "three_bits"])
def test_the_c_encoder_gives_the_torch_references_bytes(scale, dtype, table):
    values = NF4 if table == "nf4" else torch.linspace(-0.4, 0.4, 8)
    codec = CodebookCodec(values, 32, 64, scale)
    x = (torch.randn(4, 3, 9, 64, generator=GEN) * 3).to(dtype)
    x[0, 0, 0] = 0  # a group of zeros: scale 0, every code the value nearest 0
    x[0, 0, 0, 32:] = 0
    c_codes, c_scale = encode_codebook(x, 32, codec.bits, scale == "norm", codec.largest,
                                       codec.midpoints)  # fmt: skip
    codes, stored = codec.encode_torch(x)
    assert torch.equal(c_codes, codes) and torch.equal(c_scale, stored)
    decoded = codec.decode([codes, stored], torch.float32)
    grouped = x.float().unflatten(-1, (-1, 32))
    safe = torch.where(stored > 0, stored, torch.ones_like(stored)).float()[..., None]
    nearest = (grouped / safe)[..., None] - codec.table  # (..., 32, 2^bits)
    want = codec.table[nearest.abs().argmin(-1)] * stored.float()[..., None]
    torch.testing.assert_close(decoded, want.flatten(-2), atol=1e-6, rtol=1e-6)


def test_nf4_is_a_registered_format_and_attends_in_place(tiny_llama):
    assert token_formats()["nf4"].bits == (4,)
    options = dict(kv_bits=4, kv_format="nf4", kv_group_size=8)
    cache = build_cache("full", tiny_llama.cache_spec(), options)
    assert cache.describe(cache.options).startswith("NF4 keys and values")
    codec = cache.store.key_codec
    assert codec.stored(codec.encode(torch.randn(1, 2, 1, 16))).format == "codebook"


@pytest.mark.parametrize(
    ("options", "message"),
    [(dict(kv_bits=8, kv_format="nf4"), "'nf4' is a 4-bit format but kv_bits=8"),
     (dict(kv_bits=4, kv_format="nf5"), r"kv_format='nf5' is invalid; allowed: \(.*'nf4'")],
)  # fmt: skip
def test_bad_codebook_options_name_the_field(options, message, tiny_llama):
    with pytest.raises(ValueError, match=message):
        build_cache("full", tiny_llama.cache_spec(), options)


def test_a_codebook_refuses_tables_and_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="2, 4, 8 or 16 values, not 5"):
        CodebookCodec(torch.zeros(5), 32, 64)
    with pytest.raises(ValueError, match="kv_group_size=24 must divide head_dim=64"):
        CodebookCodec(NF4, 24, 64)
