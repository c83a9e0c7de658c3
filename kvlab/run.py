"""One kvlab run: load the model, build the cache, run the workload with warm-up, measure,
and return the metrics; :func:`run_point` wraps it so a failure is recorded, not raised."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlab.cache import cache_factory
from kvlab.cache.base import KVCache
from kvlab.config import (
    ModelConfig,
    QuantConfig,
    RunConfig,
    check_context,
    to_run_config,
)
from kvlab.engine import Engine, GenerationConfig, SamplingConfig
from kvlab.engine.compile_choice import compile_choice
from kvlab.engine.metrics import (
    PeakMemory,
    generation_metrics,
    prepacked_copy_bytes,
    weight_bytes,
)
from kvlab.eval import run_evals
from kvlab.kernels.attention import use_backend
from kvlab.kernels.huge_pages import put_on_huge_pages
from kvlab.kernels.plan import KernelPlan, make_plan, prepack_linears
from kvlab.models import load_model
from kvlab.models.llama import Decoder
from kvlab.paths import CONF_DIR
from kvlab.quant import quantize_
from kvlab.speculative.drafts import ModelDraft, early_exit
from kvlab.threads import apply_threads
from kvlab.tracking import config_dict, environment, read_record, write_record
from kvlab.workload import build_prompts


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device='cuda' but CUDA is not available; allowed here: cpu, auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_run_model(
    model_cfg: ModelConfig, quant: QuantConfig, device: torch.device, plan: KernelPlan | None = None
) -> tuple[Decoder, Any]:
    """The run's model holding kernel ``plan`` (default: this machine's defaults), its
    weights quantized; linear layers left
    in full precision take the plan's kernels afterwards (quantized layers take theirs as
    they are built), then the CPU weights move onto huge pages (``model.huge_pages``)."""
    dtype = resolve_dtype(model_cfg.dtype, device)
    model, tokenizer = load_model(
        model_cfg.source, dtype, device, cpu_prepack=False, plan=plan, backend=model_cfg.backend
    )
    quantize_(model, quant.name, quant.options)
    prepack_linears(model)
    if model_cfg.huge_pages:
        put_on_huge_pages(model)
    return model, tokenizer


def compose_run_config(overrides: list[str]) -> RunConfig:
    """The checked run config that ``conf/`` and Hydra-style ``overrides`` compose to,
    outside a Hydra app (the lm-eval adapter, ``kvlab diagnose``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


def build_run_model(
    cache: str, quant: str, overrides: dict[str, Any]
) -> tuple[Decoder, Any, Callable[[], KVCache]]:
    """Model, tokenizer and cache factory of the run that ``cache=<cache> quant=<quant>``
    and dotted ``overrides`` compose to (for callers outside Hydra: the lm-eval adapter)."""
    wanted = [f"cache={cache}", f"quant={quant}", *(f"{k}={v}" for k, v in overrides.items())]
    return run_model(compose_run_config(wanted))


def run_model(cfg: RunConfig) -> tuple[Decoder, Any, Callable[..., KVCache]]:
    """The run's model, its kernel plan made first (the same every run), its tokenizer, and
    a factory of the run's caches (rows that roll back the drafts ``cfg.spec`` verifies)."""
    plan = make_plan(cfg.engine.kernel_settings())
    model, tokenizer = load_run_model(cfg.model, cfg.quant, resolve_device(cfg.model.device), plan)
    rollback = cfg.spec.num_speculative_tokens if cfg.spec.enabled else 0
    return model, tokenizer, cache_factory(cfg.cache.name, model, cfg.cache.options, rollback)


def generation_config(cfg: RunConfig, new_tokens: int | None = None) -> GenerationConfig:
    w = cfg.workload
    sampling = SamplingConfig(w.temperature, w.top_k, w.top_p, w.seed)
    return GenerationConfig(
        new_tokens or w.new_tokens, sampling, w.stop_on_eos, w.prefill_chunk, cfg.spec
    )


def measure(cfg: RunConfig, out_dir: Path | None = None) -> dict[str, Any]:
    """Run the workload of ``cfg`` once after a warm-up, then its evals (their files go to
    ``out_dir``), on the decode attention backend ``engine.attention``; the metrics."""
    with use_backend(cfg.engine.attention):
        return _measure(cfg, out_dir)


def _measure(cfg: RunConfig, out_dir: Path | None) -> dict[str, Any]:
    check_context(cfg)
    apply_threads(cfg.threads)  # the CPUs this process was given, not the machine's
    device = resolve_device(cfg.model.device)
    model, tokenizer, new_cache = run_model(cfg)  # new_cache: the workload's and the evals'

    serving = cfg.workload.serving is not None
    choice = compile_choice(cfg.engine.compile, model, new_cache, cfg.workload.new_tokens,
                            serving, cfg.engine.autotune)  # fmt: skip
    decided = {"engine/compiled": choice["compile"], "engine/compile_choice": choice,
               "engine/kernel_plan": model.kernel_plan.record()}  # fmt: skip
    if serving:
        return _measure_serving(cfg, model, tokenizer, new_cache, out_dir) | decided
    compiled, draft = choice["compile"], build_draft(cfg, model)
    eos = _eos_ids(tokenizer, model)
    engine = Engine(model, new_cache(static=compiled), eos, compile=compiled, draft=draft)
    prompts = build_prompts(
        tokenizer, cfg.workload.prompt_len, cfg.workload.batch_size, cfg.workload.prompt_file
    )
    if cfg.workload.warmup:
        engine.generate(prompts, generation_config(cfg, new_tokens=2))
    with PeakMemory(device) as peak:
        run = engine.generate(prompts, generation_config(cfg))
    metrics = generation_metrics(run.stats) | peak.metrics | _model_facts(model)
    if draft is not None:  # what the draft adds (an early exit shares the model's weights)
        shared = cfg.spec.method == "layerskip"
        metrics["spec/draft_weight_bytes"] = 0 if shared else weight_bytes(draft.engine.model)
        metrics["spec/draft_compiled"] = draft.engine.compiled
        metrics["spec/draft_compile_choice"] = draft.compile_choice
    metrics["new_tokens"] = sum(len(t) for t in run.tokens)
    metrics |= decided
    metrics["sample_text"] = tokenizer.decode(run.tokens[0])[:300]
    return metrics | run_evals(model, tokenizer, new_cache, cfg.eval, out_dir)


def build_draft(cfg: RunConfig, model: Decoder) -> ModelDraft | None:
    """The run's draft model over its own cache (``spec.method`` self, layerskip or model),
    its steps compiled as ``engine.compile`` decides for the draft's own weights and cache;
    None for prompt lookup and plain decoding, which need none."""
    spec = cfg.spec
    if not spec.drafts_with_a_model:
        return None
    if spec.method == "layerskip":
        draft = early_exit(model, spec.layers)
    else:
        source = spec.model or cfg.model.source
        quant = QuantConfig(spec.quant, spec.quant_options)
        device = model.embed_tokens.weight.device
        model_cfg = dataclasses.replace(cfg.model, source=source)
        draft, _ = load_run_model(model_cfg, quant, device, model.kernel_plan)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"spec.model={spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens "
            f"and model={cfg.model.source!r} one of {model.config.vocab_size}; allowed: a "
            "draft with the model's tokenizer"
        )
    new_cache = cache_factory(spec.cache, draft, spec.cache_options, spec.num_speculative_tokens)
    choice = compile_choice(cfg.engine.compile, draft, new_cache, cfg.workload.new_tokens,
                            serving=False, autotune=cfg.engine.autotune)  # fmt: skip
    return ModelDraft(draft, new_cache(static=choice["compile"]), choice)


def _measure_serving(cfg, model, tokenizer, new_cache, out_dir) -> dict[str, Any]:
    """``workload=serving``: the trace served under the KV budget (then the evals)."""
    from kvlab.serving.study import measure_serving

    w, device = cfg.workload, model.embed_tokens.weight.device
    sampling = SamplingConfig(w.temperature, w.top_k, w.top_p, w.seed)
    eos = frozenset(_eos_ids(tokenizer, model)) if w.stop_on_eos else frozenset()
    with PeakMemory(device) as peak:
        metrics = measure_serving(
            model, tokenizer, new_cache, w.serving, sampling, eos, w.warmup, out_dir, cfg.spec
        )
    metrics |= peak.metrics | _model_facts(model)
    return metrics | run_evals(model, tokenizer, new_cache, cfg.eval, out_dir)


def _model_facts(model: Decoder) -> dict[str, Any]:
    """What every workload's metrics say of the model: its weight bytes, device and dtype."""
    weight = model.embed_tokens.weight
    return {
        "model/backend": model.backend,
        "weight_bytes": weight_bytes(model),
        "weight_prepacked_copy_bytes": prepacked_copy_bytes(model),
        "weight_huge_page_bytes": model.huge_page_bytes,
        "device": str(weight.device),
        "dtype": str(weight.dtype).removeprefix("torch."),
    }


def _eos_ids(tokenizer: Any, model: Any) -> list[int]:
    ids = set(model.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def run_point(cfg: RunConfig, out_dir: Path) -> dict[str, Any]:
    """Measure one point and write ``out_dir/result.json``; errors become ``status: failed``.
    With ``cfg.resume`` a point already recorded ok for the same config is not run again."""
    config = config_dict(cfg)
    previous = read_record(out_dir)
    if cfg.resume and previous and previous.get("status") == "ok" and previous["config"] == config:
        return previous | {"skipped": True}
    record: dict[str, Any] = {"config": config}
    start = time.time()
    try:
        record |= {"status": "ok", "metrics": measure(cfg, out_dir)}
    except Exception as exc:  # a sweep must go on: the failure is recorded with its traceback
        record |= {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    end = time.time()
    record |= {"duration_s": end - start, "started_at": start, "ended_at": end}
    record["environment"] = environment()  # after the run: the threads and kernels it used
    write_record(out_dir, record)
    return record
