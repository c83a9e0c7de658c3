"""kvlab's C prefill attention (bf16, AVX512-BF16) against an fp32 reference, as close as
torch's own bf16 SDPA is; a bf16 model's prefill logits through it equal the SDPA path's
over the full and the paged caches, in one pass and in chunks over a stored context; the
kernel plan chooses it by capability."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.kernels import plan as kernel_plan
from kvlab.kernels.attention import prefill

needs_kernel = pytest.mark.skipif(not prefill.available(), reason="no AVX512-BF16 kernel here")


def positional_mask(offsets: torch.Tensor, steps: int, keys: int) -> torch.Tensor:
    """(B, 1, T, L): query i of row b sees the keys at positions up to offsets[b] + i."""
    position = offsets[:, None] + torch.arange(steps)[None]
    return (torch.arange(keys)[None, None, :] <= position[:, :, None])[:, None]


# (B, H, H_kv, T, L, D, first offset): GQA groups of 3, 4 and 1, chunks after a context,
# a single query, lengths that are no multiple of the kernel's blocks, D of 64 and 128
SHAPES = [(1, 9, 3, 256, 256, 64, 0), (2, 9, 3, 37, 100, 64, 40), (1, 4, 4, 70, 70, 64, 0),
          (3, 8, 2, 33, 200, 128, 150), (1, 9, 3, 1, 50, 64, 49),
          (2, 6, 3, 65, 65, 64, 0)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_as_close_to_fp32_as_torchs_bf16_sdpa(shape):
    batch, heads, kv_heads, steps, keys, dim, first = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, heads, steps, dim, generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen).bfloat16() for _ in "kv")
    offsets = torch.tensor([min(first + 7 * b, keys - steps) for b in range(batch)])
    mask = positional_mask(offsets, steps, keys)
    group = heads // kv_heads
    wide = [t.float().repeat_interleave(group, 1) for t in (k, v)]
    want = F.scaled_dot_product_attention(q.float(), *wide, attn_mask=mask)
    torchs = F.scaled_dot_product_attention(
        q, *(t.repeat_interleave(group, 1) for t in (k, v)), attn_mask=mask
    )
    got = prefill.prefill_attention(q, k, v, offsets, dim**-0.5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    error, torchs_error = ((x.float() - want).abs() for x in (got, torchs))
    assert error.max() <= 2 * torchs_error.max() + 1e-3
    assert error.mean() <= 1.5 * torchs_error.mean() + 1e-5


@needs_kernel
def test_strided_queries_and_keys_read_as_contiguous_ones():
    """Queries as a layer makes them (a transposed view) and keys inside a wider buffer."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 9, 64, generator=gen).bfloat16().transpose(1, 2)  # (1, 9, 40, 64)
    buffer = torch.randn(1, 3, 80, 64, generator=gen).bfloat16()
    k, v = buffer[:, :, :50], torch.randn(1, 3, 50, 64, generator=gen).bfloat16()
    offsets = torch.tensor([10])
    strided = prefill.prefill_attention(q, k, v, offsets, 0.125)
    plain = prefill.prefill_attention(q.contiguous(), k.contiguous(), v, offsets, 0.125)
    assert torch.equal(strided, plain)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A random 2-layer Llama whose heads are 64 wide (the kernel's), in bf16."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512)  # fmt: skip
    path = tmp_path_factory.mktemp("head64")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return load_model(str(path), dtype=torch.bfloat16)[0]


def prompt_logits(model, name: str, chunk: int) -> torch.Tensor:
    """Logits of two prompts of 150 and 96 tokens fed ``chunk`` tokens a forward."""
    cache = build_cache(name, model.cache_spec())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 150), generator=gen)
    lengths = [150, 96]
    cache.allocate(2, 160)
    out = []
    with torch.inference_mode():
        for start in range(0, 150, chunk):
            part = ids[:, start : start + chunk]
            fed = [max(0, min(n - start, part.shape[1])) for n in lengths]
            positions = start + torch.arange(part.shape[1]).expand(2, -1)
            out.append(model(part, positions, cache, fed))
    logits = torch.cat(out, dim=1)
    return torch.cat([logits[0, :150], logits[1, :96]])


@needs_kernel
@pytest.mark.parametrize("name", ["full", "paged"])
@pytest.mark.parametrize("chunk", [150, 64])
def test_a_bf16_prefill_through_the_kernel_gives_the_sdpa_paths_logits(
    bf16_model, name, chunk, monkeypatch
):
    assert kernel_plan.default_plan().prefill_attention == "kvlab"
    calls = []
    original = prefill.prefill_attention
    monkeypatch.setattr(prefill, "prefill_attention", lambda *a: calls.append(1) or original(*a))
    kernel = prompt_logits(bf16_model, name, chunk)
    assert calls  # the kernel ran
    sdpa_plan = dataclasses.replace(kernel_plan.default_plan(), prefill_attention="sdpa")
    monkeypatch.setattr(kernel_plan, "default_plan", lambda: sdpa_plan)
    calls.clear()
    reference = prompt_logits(bf16_model, name, chunk)
    assert not calls
    torch.testing.assert_close(kernel.float(), reference.float(), atol=0.05, rtol=0.05)
    assert (kernel.argmax(-1) == reference.argmax(-1)).float().mean() > 0.97


def test_the_plan_chooses_the_prefill_kernel_by_capability():
    cap = dict(kernel_plan.capability())
    for has, want in ((True, "kvlab"), (False, "sdpa")):
        chosen = kernel_plan.make_plan(cap=cap | {"c_prefill_attention_bf16": has})
        assert chosen.prefill_attention == want
        assert chosen.record()["prefill_attention"] == want
