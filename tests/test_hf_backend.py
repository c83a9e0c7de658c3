"""``model.backend=hf``: transformers' own model classes inside kvlab's engine, on tiny random
models transformers builds from configs (no download). ``full`` gives transformers' own
``generate`` tokens and logits; every strategy's exact setting equals recomputation; the
native and hf backends agree where both run; what the backend cannot serve is refused
before any weight loads."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from kvlab.cache import build_cache, registered
from kvlab.cache.base import cache_options
from kvlab.engine import Engine, GenerationConfig

BASE = TINY | dict(  # conftest's tiny shape, with token ids inside its vocabulary
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # generation runs its whole length on both sides
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HF_FAMILIES = {
    "llama": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, **MOE, decoder_sparse_step=1, mlp_only_layers=[]),
    "phi3": {},
    "smollm3": dict(no_rope_layers=[1, 0]),  # layer 1 attends without RoPE
    "mistral": dict(head_dim=16, sliding_window=None),
    "gemma3_text": dict(  # a trained window beside a global layer, each with its own RoPE
        head_dim=16,
        query_pre_attn_scalar=24,  # scores scaled otherwise than by the head width
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "deepseek_v3": dict(  # MLA: keys 16 wide (8 without RoPE + 8 with), values 8
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "gpt_oss": dict(  # learned attention sinks, a 128-token window shrunk to 8, MoE
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8
    ),
}
REFUSED = {  # model_type, config, the reason's words
    "qwen3_next": (
        dict(head_dim=16, layer_types=["linear_attention", "full_attention"]),
        "linear_attention",
    ),
}
TOLERANCE = 1e-5


def tiny_causal_lm(model_type: str, extra: dict):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, **(BASE | extra))
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random, non-trivial norms and biases so every weight matters
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("sinks"):  # sinks that take a real share of each softmax
                param.copy_(torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families")
    for family, extra in HF_FAMILIES.items():
        tiny_causal_lm(family, extra).save_pretrained(root / family)
    return root


def load(path, backend="hf"):
    from kvlab import load_model

    model, _ = load_model(str(path), backend=backend)
    return model


def reference(path):
    """transformers' own model on the same checkpoint, its own attention (SDPA where the
    family has it, else eager) and cache."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path).eval()


def prompt(length=21, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, BASE["vocab_size"], (length,), generator=gen).tolist()


def generated(model, name, tokens, steps, options=None, chunk=0):
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    seen = []
    cfg = GenerationConfig(steps, stop_on_eos=False, prefill_chunk=chunk)
    run = engine.generate([tokens], cfg, on_logits=lambda logits, rows: seen.append(logits.clone()))
    return torch.cat(seen), run.tokens[0]


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_full_gives_transformers_generate_tokens_and_logits(family, hf_checkpoints):
    path = hf_checkpoints / family
    model, hf = load(path), reference(path)
    tokens = prompt()
    logits, ours = generated(model, "full", tokens, steps=10, chunk=5)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([tokens]),
            max_new_tokens=10,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    theirs = out.sequences[0, len(tokens) :].tolist()
    assert ours == theirs
    assert (logits - torch.cat(out.logits)).abs().max() <= TOLERANCE
    assert model.config.model_type == family and model.backend == "hf"


def servable(model, name, options):
    from kvlab.models.hf_backend import strategy_refusal

    return strategy_refusal(model.config, name, cache_options(name, options)) is None


@pytest.mark.parametrize("name", sorted(registered()))
@pytest.mark.parametrize(
    "family", ["deepseek_v3", "qwen3_moe", "smollm3", "gemma3_text", "gpt_oss"]
)
def test_exact_setting_of_every_strategy_equals_recomputation(family, name, hf_checkpoints):
    """MLA (values narrower than keys), MoE, layers without RoPE, a trained window beside a
    global layer (past the window: the prompt is longer): every strategy's exact setting
    equals a full causal pass over the tokens so far; the strategies that re-rotate keys are
    refused where the model's RoPE is not the plain rotation."""
    model = load(hf_checkpoints / family)
    options = registered()[name].tests.exact
    if not servable(model, name, options):
        assert not model.config.plain_rope
        return
    tokens = prompt()
    logits, ours = generated(model, name, tokens, steps=6, options=options)
    for i in range(len(ours)):
        seen = tokens + ours[:i]
        cache = build_cache("nocache", model.cache_spec())
        with torch.inference_mode():
            scratch = model(torch.tensor([seen]), torch.arange(len(seen))[None], cache)[:, -1]
        assert (logits[i] - scratch[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["int4", "paged", "sliding", "evict", "quest"])
def test_lossy_strategies_run_and_hold_their_tensors_bytes(name, hf_checkpoints):
    model = load(hf_checkpoints / "qwen3_moe")
    cache = build_cache(name, model.cache_spec(), registered()[name].tests.lossy)
    run = iter(Engine(model, cache).stream([prompt(40)], GenerationConfig(8, stop_on_eos=False)))
    next(run)  # after prefill, the row held
    report = cache.memory()
    assert report.held_bytes == sum(t.numel() * t.element_size() for t in cache.tensors())
    assert 0 < report.used_bytes <= report.held_bytes
    assert len(list(run)) == 7


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_native_and_hf_backends_agree(family, hf_checkpoints):
    """Where both run (a model attending over the whole context), the same logits."""
    path = hf_checkpoints / family
    tokens = prompt()
    native, native_tokens = generated(load(path, "native"), "full", tokens, steps=8)
    hf, hf_tokens = generated(load(path, "hf"), "full", tokens, steps=8)
    assert native_tokens == hf_tokens
    assert (native - hf).abs().max() <= TOLERANCE


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_what_the_backend_cannot_serve_is_refused_before_loading(model_type, tmp_path):
    extra, words = REFUSED[model_type]
    tiny_causal_lm(model_type, extra).config.save_pretrained(tmp_path)  # a config, no weights
    with pytest.raises(ValueError, match=rf"model.backend=hf: .*{words}"):
        load(tmp_path)


def test_a_strategy_that_re_rotates_keys_is_refused_where_rope_is_not_plain(hf_checkpoints):
    from kvlab.models.hf_backend import strategy_refusal

    model = load(hf_checkpoints / "deepseek_v3")
    refusal = strategy_refusal(model.config, "compressed", cache_options("compressed", {}))
    assert "re-rotates keys" in refusal and "deepseek_v3" in refusal
    assert strategy_refusal(load(hf_checkpoints / "qwen3").config, "compressed", None) is None


def test_a_run_through_the_cli_config_records_the_backend(smollm2, tmp_path):
    """``kvlab model.source=<a Qwen3-MoE checkpoint>``: auto picks transformers' class, a
    quantizer and a lossy strategy apply, perplexity runs through the cache, an int4 copy
    of the model drafts for it over a paged cache, and the result says which backend ran;
    a strategy the model cannot serve fails before loading."""
    from kvlab.run import compose_run_config, run_point

    tokenizer = smollm2[1]
    extra = HF_FAMILIES["qwen3_moe"] | {"vocab_size": len(tokenizer), "eos_token_id": 2}
    tiny_causal_lm("qwen3_moe", extra).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    overrides = [
        f"model.source={tmp_path / 'moe'}",
        "cache=int4",
        "cache.options.group_size=16",  # the tiny heads are 16 wide
        "quant=rtn",
        "workload.prompt_len=48",
        "workload.new_tokens=8",
        "eval=ppl",
        "eval.ppl.seqlen=64",
        "eval.ppl.max_windows=1",
        "eval.ppl.chunk=16",
    ]
    record = run_point(compose_run_config(overrides), tmp_path / "run")
    assert record["status"] == "ok", record.get("error")
    metrics = record["metrics"]
    assert metrics["model/backend"] == "hf" and metrics["kv_bytes"] > 0
    assert 1 < metrics["wikitext2/ppl"] < float("inf")
    speculating = [overrides[0], "cache=paged", "workload.prompt_len=48", "spec=self"]
    record = run_point(compose_run_config(speculating), tmp_path / "spec")
    assert record["status"] == "ok", record.get("error")
    assert record["metrics"]["spec/drafted"] > 0

    tiny_causal_lm("deepseek_v3", HF_FAMILIES["deepseek_v3"]).save_pretrained(tmp_path / "mla")
    refused = [f"model.source={tmp_path / 'mla'}", "cache=compressed", "workload.prompt_len=16"]
    record = run_point(compose_run_config(refused), tmp_path / "refused")
    assert record["status"] == "failed" and "re-rotates keys" in record["error"]


def test_a_windowed_model_holds_a_ring_of_its_window_beside_the_full_layers(hf_checkpoints):
    """Gemma-3's sliding layer keeps 8 tokens whatever the context, its global layer the
    run's strategy: the cache holds less than the layer count times the context, and says
    what each group holds; ``auto`` picks transformers' class for a model with windows."""
    from kvlab.cache.layered import LayeredCache
    from kvlab.models.loading import resolve_backend

    path = hf_checkpoints / "gemma3_text"
    assert resolve_backend(str(path)) == "hf"
    assert resolve_backend(str(hf_checkpoints / "llama")) == "native"
    model = load(path)
    cache = build_cache("full", model.cache_spec())
    assert isinstance(cache, LayeredCache)
    cache.allocate(1, 64)
    groups = cache.group_bytes()
    assert groups["full"] > 4 * groups["window=8"] > 0  # 64 slots against a ring of 8


@pytest.mark.parametrize("name", ["full", "paged", "int4", "quest", "sliding"])
def test_speculation_over_a_windowed_model_gives_plain_decodings_tokens(name, hf_checkpoints):
    """Gemma-3's window rings keep CacheSpec.rollback slots beyond the window (the prompts
    and drafts run past it), so rejected drafts roll every group back to what plain decoding
    keeps: greedy speculation gives its tokens, one row or a batch. A ring built without the
    margin is refused with the reason."""
    import dataclasses

    from test_speculative import EXACT, NGRAM, repetitive_prompts

    from kvlab.speculative import SpecConfig

    model = load(hf_checkpoints / "gemma3_text")
    prompts = repetitive_prompts(BASE["vocab_size"])

    def run(spec, rollback):
        cache_spec = dataclasses.replace(model.cache_spec(), rollback=rollback)
        engine = Engine(model, build_cache(name, cache_spec, EXACT[name]))
        return engine.generate(prompts, GenerationConfig(12, stop_on_eos=False, spec=spec))

    plain = run(SpecConfig(), 0)
    speculative = run(NGRAM, NGRAM.num_speculative_tokens)
    assert speculative.tokens == plain.tokens and speculative.stats.drafted > 0
    assert speculative.stats.accepted < speculative.stats.drafted  # some drafts rolled back
    with pytest.raises(ValueError, match="8-token window keeps 0 slots beyond it"):
        run(NGRAM, 0)


def test_a_windowed_model_scores_lm_eval_items_serves_and_speculates(smollm2, tmp_path):
    """lm-eval's items (a context's endings continue copies of its rows: fork and join), a
    serving trace and speculative decoding (its rings built with the drafts' margin) run
    over Gemma-3's per-group cache from the CLI's config."""
    from kvlab.run import compose_run_config, measure

    tokenizer = smollm2[1]
    extra = HF_FAMILIES["gemma3_text"] | {"vocab_size": len(tokenizer), "eos_token_id": 2}
    tiny_causal_lm("gemma3_text", extra).save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")
    source = [f"model.source={tmp_path / 'gemma'}", "workload.prompt_len=48"]
    lm_eval = ["eval=lm_eval", "eval.lm_eval.limit=2", "eval.lm_eval.tasks=[hellaswag_local]"]
    metrics = measure(compose_run_config(source + lm_eval), tmp_path)
    assert metrics["hellaswag/items"] == 2 and metrics["model/backend"] == "hf"
    metrics = measure(compose_run_config(source + ["spec=ngram", "cache=paged"]), tmp_path)
    assert metrics["spec/drafted"] > 0 and metrics["new_tokens"] > 0
    serving = [
        source[0],
        "workload=serving",
        "cache=paged",
        "workload.serving.num_requests=6",
        "workload.serving.prompt_len.kind=fixed",
        "workload.serving.prompt_len.value=40",
        "workload.serving.output_len.kind=fixed",
        "workload.serving.output_len.value=8",
        "workload.serving.kv_budget_gib=0.001",
        "workload.serving.chunk=16",
    ]
    metrics = measure(compose_run_config(serving), tmp_path)
    assert metrics["completed"] == 6 and metrics["output_throughput"] > 0


@pytest.mark.parametrize("name", ["full", "paged", "int4", "sliding", "gqa_shared"])
def test_the_memory_model_predicts_a_windowed_models_bytes_group_by_group(name, hf_checkpoints):
    """`kvlab memory` reads each layer's window from the config: its prediction for
    Gemma-3's window ring beside the global layer's strategy equals the tensors held."""
    import json

    from kvlab.analysis.memory import Architecture, kv_bytes

    path = hf_checkpoints / "gemma3_text"
    model = load(path)
    arch = Architecture.from_config(json.loads((path / "config.json").read_text()))
    assert arch.layer_windows == model.cache_spec().layer_windows == (8, None)
    options = registered()[name].tests.lossy
    cache = build_cache(name, model.cache_spec(), options)
    batch = [prompt(11), prompt(17, seed=4), prompt(3, seed=5)]
    held = Engine(model, cache).generate(batch, GenerationConfig(6, stop_on_eos=False))
    planned = kv_bytes(arch, name, options, context=17 + 6, batch=3, dtype=torch.float32)
    assert "window=8" in planned
    assert held.stats.kv_peak.held_bytes == sum(planned.values())


@pytest.mark.parametrize("name", ["full", "paged", "int4", "sliding"])
def test_a_windowed_model_serves_each_request_what_it_generates_alone(name, hf_checkpoints):
    """Continuous batching over Gemma-3's per-group cache (each group serving its share of
    one budget): joining, leaving and chunked prefill change nothing but timing."""
    from tests.test_scheduler import check_serving_equals_alone

    model = load(hf_checkpoints / "gemma3_text")
    check_serving_equals_alone(model, name, registered()[name].tests.lossy)


@pytest.mark.slow
def test_the_cli_sweeps_strategies_speculation_and_serving_over_a_tiny_gemma3(smollm2, tmp_path):
    """``kvlab -m model.source=<tiny gemma3> cache=full,int4,paged,evict,quest`` with and
    without ``spec=ngram``, and under ``workload=serving``: every point runs (eviction's
    default budget drops nothing of these short rows, so its drafts roll back) but serving
    eviction, which cannot join a running batch: recorded as failed with the reason while
    the sweep goes on."""
    import subprocess
    import sys

    from kvlab.tracking import load_results

    tokenizer = smollm2[1]
    extra = HF_FAMILIES["gemma3_text"] | {  # heads as wide as int4's default group
        "vocab_size": len(tokenizer), "eos_token_id": 2, "head_dim": 32,
    }  # fmt: skip
    tiny_causal_lm("gemma3_text", extra).save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")
    caches = "cache=full,int4,paged,evict,quest"
    common = [f"model.source={tmp_path / 'gemma'}", caches]
    sweeps = {
        "offline": ["spec=none,ngram", "workload.prompt_len=24", "workload.new_tokens=6"],
        "serving": ["workload=serving", "workload.serving.num_requests=4",
                    "workload.serving.prompt_len.kind=fixed",
                    "workload.serving.prompt_len.value=24",
                    "workload.serving.output_len.kind=fixed",
                    "workload.serving.output_len.value=4"],
    }  # fmt: skip
    for name, args in sweeps.items():
        sweep = tmp_path / name
        command = [sys.executable, "-m", "kvlab.cli", "-m", *common, *args,
                   f"hydra.sweep.dir={sweep}"]  # fmt: skip
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = load_results(sweep)
        assert len(rows) == (10 if name == "offline" else 5)
        for row in rows:
            if name == "serving" and row["cache.name"] == "evict":
                assert row["status"] == "failed" and "joining a running batch" in row["error"]
            else:
                assert row["status"] == "ok" and row["model/backend"] == "hf", row


@pytest.mark.parametrize("name", ["full", "int4", "sliding"])
def test_the_memory_model_shows_mlas_latent_beside_the_decompressed_cache(name, hf_checkpoints):
    """DeepSeek-V3 under hf stores its decompressed keys and values: the memory model's line
    for a strategy equals the tensors held, and its ``native`` line is the latent MLA's own
    cache would hold instead, far smaller."""
    import json

    from kvlab.analysis.memory import Architecture, kv_bytes

    path = hf_checkpoints / "deepseek_v3"
    model = load(path)
    config = json.loads((path / "config.json").read_text())
    arch = Architecture.from_config(config)
    options = registered()[name].tests.lossy
    cache = build_cache(name, model.cache_spec(), options)
    held = Engine(model, cache).generate([prompt(11), prompt(17, seed=4)],
                                         GenerationConfig(6, stop_on_eos=False))  # fmt: skip
    planned = kv_bytes(arch, name, options, context=17 + 6, batch=2, dtype=torch.float32)
    assert held.stats.kv_peak.held_bytes == sum(planned.values())
    latent = kv_bytes(arch, "native", context=23, batch=2, dtype=torch.float32)
    per_token = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert latent["latent"] == config["num_hidden_layers"] * 23 * per_token * 4 * 2
    full = kv_bytes(arch, "full", context=23, batch=2, dtype=torch.float32)
    assert sum(full.values()) > 4 * latent["latent"]  # 4 heads x (16 + 16) against 24 wide
