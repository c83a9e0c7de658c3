"""Every file under conf/ composes into a valid run config; bad values fail early with a
message naming the field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvlab.config import (
    CacheConfig,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    RunConfig,
    ServingConfig,
    WorkloadConfig,
    check_context,
    to_run_config,
)
from kvlab.paths import CONF_DIR
from kvlab.speculative import SpecConfig

GROUPS = sorted(
    (group.name, option.stem)
    for group in Path(CONF_DIR).iterdir()
    if group.is_dir() and group.name != "hydra"
    for option in group.glob("*.yaml")
)


@pytest.mark.parametrize(("group", "option"), GROUPS)
def test_every_config_file_composes(group, option):
    prefix = "+" if group == "experiment" else ""  # experiments are not in the defaults
    overrides = [f"{prefix}{group}={option}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        if group == "experiment":  # an experiment defines its grid
            full = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            assert full.hydra.sweeper.params
    assert isinstance(to_run_config(cfg), RunConfig)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: WorkloadConfig(prompt_len=-1), r"workload.prompt_len=-1 .*>= 1"),
        (lambda: WorkloadConfig(new_tokens=0), r"workload.new_tokens=0"),
        (lambda: WorkloadConfig(top_p=1.5), r"workload.top_p=1.5"),
        (lambda: CacheConfig(name="bogus"), r"cache.name='bogus' .*full.*nocache"),
        (lambda: ModelConfig(dtype="int3"), r"model.dtype='int3' .*float32"),
        (lambda: RunConfig(threads=-2), r"threads=-2"),
        (lambda: ServingConfig(), r"kv_budget_bytes/kv_budget_gib=\(0, 0.0\) .*exactly one"),
        (lambda: ServingConfig(kv_budget_gib=1, rate=-1), r"workload.serving.rate=-1"),
        (
            lambda: ServingConfig(kv_budget_gib=1, prompt_len=LengthConfig("zipf")),
            r"workload.serving.prompt_len: kind='zipf' is invalid; allowed: .*longtail",
        ),
        (lambda: WorkloadConfig(kind="offline"), r"workload.kind='offline' .*serving"),
        (lambda: EngineConfig(attention="cuda"), r"engine.attention='cuda'.*auto, c, gpu"),
        (
            lambda: WorkloadConfig(serving=ServingConfig(kv_budget_gib=1)),
            r"workload.serving=.* exactly when workload.kind=serving",
        ),
        (
            lambda: RunConfig(
                workload=WorkloadConfig("serving", ServingConfig(kv_budget_gib=1)),
                engine=EngineConfig(compile=True),
            ),
            r"engine.compile=True .*false with workload=serving",
        ),
        (
            lambda: RunConfig(
                workload=WorkloadConfig("serving", ServingConfig(kv_budget_gib=1)),
                spec=SpecConfig("layerskip", layers=4),
            ),
            r"spec.method='layerskip' .*none or ngram with workload=serving",
        ),
    ],
)
def test_bad_values_name_field_value_and_allowed(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_prompt_longer_than_context_fails_before_loading():
    cfg = RunConfig(workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
    with pytest.raises(ValueError, match=r"8500 tokens exceeds the context .*<= 8192"):
        check_context(cfg)


LAUNCHERS = sorted(p.stem for p in (Path(CONF_DIR) / "hydra" / "launcher").glob("*.yaml"))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_config_composes(launcher):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True
        )
    assert "launcher" in cfg.hydra.launcher._target_.lower()


def test_serving_with_prompt_lookup_over_a_cache_that_cannot_roll_back_fails_early():
    serving = ServingConfig(kv_budget_gib=1)
    cfg = RunConfig(
        cache=CacheConfig(name="compressed"),
        workload=WorkloadConfig("serving", serving),
        spec=SpecConfig("ngram"),
    )
    with pytest.raises(ValueError, match="spec.method='ngram' .* cache=compressed cannot"):
        check_context(cfg)


def test_a_serving_trace_longer_than_the_context_fails_before_loading():
    lengths = dict(prompt_len=LengthConfig("uniform", 100, 10, 8000))
    serving = ServingConfig(kv_budget_gib=1, shared_prefix=100, **lengths)
    cfg = RunConfig(workload=WorkloadConfig("serving", serving))
    with pytest.raises(ValueError, match=r"longest workload.serving request = 8356 tokens"):
        check_context(cfg)


def test_cache_positions_may_run_past_the_context():
    streaming = CacheConfig(name="sliding", options=dict(window=1024, positions="cache"))
    check_context(
        RunConfig(cache=streaming, workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
    )
    original = CacheConfig(name="sliding", options=dict(window=1024))
    with pytest.raises(ValueError, match="exceeds the context"):
        check_context(
            RunConfig(cache=original, workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
        )


def test_composed_overrides_reach_the_run():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["cache=nocache", "workload.prompt_len=256", "threads=1"],
        )
    run = to_run_config(cfg)
    assert (run.cache.name, run.workload.prompt_len, run.threads) == ("nocache", 256, 1)


def test_any_option_of_a_preset_is_settable_without_a_plus():
    """A preset's yaml lists only what it changes; the strategy's other options (a format
    on the ring store, an option beside a swept preset) still set by name."""
    run = composed("cache=sliding", "cache.options.kv_bits=8", "cache.options.kv_format=e4m3")
    assert (run.cache.options["kv_bits"], run.cache.options["kv_format"]) == (8, "e4m3")
    assert composed("cache=int4", "cache.options.rotate=hadamard").cache.options["rotate"] == (
        "hadamard"
    )


def composed(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+cache.options.nonexistent=1"], r"cache.options.nonexistent=1 is not an option; "
                                           r"allowed: .*block_size|cache.options.nonexistent"),
        (["cache=paged", "cache.options.nonexistent=1"], r"cache.options.nonexistent=1 is not "
                                                         r"an option; allowed: .*block_size"),
        (["quant=rtn", "+quant.options.nonexistent=1"], r"quant.options.nonexistent=1 is not"),
        (["eval=ppl", "+eval.ppl.nonexistent=1"], r"eval.ppl.nonexistent=1 is not an option"),
        (["cache=int4", "cache.options.bits=8"], r"cache.options.bits=8 contradicts cache=int4"),
        (["workload.prompt_file=/no/such/prompts.txt"], r"workload.prompt_file=.*existing"),
        (["eval=ppl", "eval.ppl.dataset=/no/such/text.txt"], r"eval.ppl.dataset=.*not a file"),
    ],
)  # fmt: skip
def test_bad_configs_fail_before_loading_with_kvlab_messages(overrides, message):
    with pytest.raises(ValueError, match=message):
        composed(*overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval=longctx", "eval.longctx.lengths=[100000]"], r"eval.longctx.lengths=\[100000\]"),
        (["eval=ppl", "eval.ppl.seqlen=100000"], r"eval.ppl.seqlen=100000 = 100000 tokens"),
    ],
)
def test_eval_contexts_past_the_model_are_refused_before_loading(overrides, message):
    cfg = composed(*overrides)
    with pytest.raises(ValueError, match=message + ".*exceeds the context"):
        check_context(cfg)


def test_models_trained_with_a_sliding_window_are_refused_past_it_natively(tmp_path):
    """kvlab's decoder attends over the whole context: past a trained window that would be
    another model than the checkpoint, so such runs fail before loading (never a warning);
    ``auto`` runs such a model through transformers' class, which keeps its window."""
    import json

    config = dict(model_type="mistral", sliding_window=16, max_position_embeddings=512,
                  vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(source=str(tmp_path), backend="native")
    inside = RunConfig(model=model, workload=WorkloadConfig(prompt_len=8, new_tokens=8))
    check_context(inside)
    past = RunConfig(model=model, workload=WorkloadConfig(prompt_len=16, new_tokens=8))
    with pytest.raises(ValueError, match="24 tokens exceeds the 16-token sliding window"):
        check_context(past)
    auto = ModelConfig(source=str(tmp_path))
    check_context(RunConfig(model=auto, workload=WorkloadConfig(prompt_len=16, new_tokens=8)))


@pytest.mark.parametrize(
    ("config", "window"),
    [
        (dict(model_type="mistral", sliding_window=4096), 4096),
        (dict(model_type="mistral", sliding_window=None), None),
        (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=False), None),
        (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=True,
              max_window_layers=28, num_hidden_layers=28), None),
        (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=True,
              max_window_layers=20, num_hidden_layers=28), 4096),
        (dict(model_type="qwen3", sliding_window=64,
              layer_types=["full_attention", "sliding_attention"]), 64),
        (dict(model_type="llama", sliding_window=64, layer_types=["full_attention"] * 2), None),
    ],
)  # fmt: skip
def test_trained_sliding_windows_are_read_as_transformers_applies_them(config, window):
    from kvlab.models.config import DecoderConfig

    assert DecoderConfig.sliding_window_of(config) == window


def test_report_labels_name_how_a_strategy_stores_kv():
    """int4 (KIVI) and paged kv_bits=4 (per-token) are different quantizers: labels say so."""
    from kvlab.analysis.report import series_label

    kivi = series_label({"cache.name": "int4", "cache.options.bits": 4})
    per_token = series_label({"cache.name": "paged", "cache.options.kv_bits": 4})
    assert "KIVI int4: keys per channel" in kivi
    assert "per-token int4 keys and values, no exact residual" in per_token
    assert series_label({"cache.name": "full"}) == "full"


def test_every_composed_preset_names_its_axes_in_its_yaml():
    """conf/cache/<name>.yaml, where a preset has one, states the preset's policy, store and
    codec, as registered (the built-ins all have one)."""
    from omegaconf import OmegaConf

    from kvlab.cache.composed import axes_of, compositions

    for name in compositions():
        path = Path(CONF_DIR) / "cache" / f"{name}.yaml"
        if path.exists() or name in BUILT_IN_PRESETS:
            yaml = OmegaConf.load(path)
            assert (yaml.policy, yaml.store, yaml.codec) == axes_of(name), name


BUILT_IN_PRESETS = ("full", "paged", "quest", "sliding", "evict", "gqa_shared", "compressed",
                    "int8", "int4", "int2")  # fmt: skip


def test_a_preset_declared_outside_conf_composes_with_its_defaults():
    """A strategy registered in Python alone (a policy file's own preset) is a ``cache=``
    choice too: kvlab registers a config entry for it, and its options are checked."""
    from kvlab.cache import base, composed
    from kvlab.cache.policies.keep_all import KeepAll
    from kvlab.cache.stores.contiguous import ContiguousStore
    from kvlab.config import register_configs

    name = "keep_all_declared_in_python"
    composed.preset(name, KeepAll, ContiguousStore)
    try:
        register_configs()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = to_run_config(compose(config_name="config", overrides=[f"cache={name}"]))
            assert cfg.cache.name == name and cfg.cache.options == {}
            bogus = [f"cache={name}", "+cache.options.bogus=1"]
            with pytest.raises(ValueError, match=r"cache.options.bogus=1 is not an option"):
                to_run_config(compose(config_name="config", overrides=bogus))
    finally:
        base._REGISTRY.pop(name)
        composed._COMPOSITIONS.pop(name)


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (dict(name="full", store="paged"), r"keep_all × paged × per_token is cache=paged"),
        (dict(name="full", codec="kivi"), r"is cache=int2 or int4 or int8"),
        (dict(name="paged", codec="kivi"), r"does not compose: codec kivi keeps an exact"),
        (dict(name="sliding", store="paged"), r"policy window composes with stores \['ring'\]"),
        (dict(name="full", store="disk"), r"cache.store='disk' is invalid; allowed: \["),
        (dict(name="nocache", store="ring"), r"not a choice on the three axes"),
        (dict(name="compressed", store="paged"), r"policy pooled composes with stores"),
    ],
)
def test_a_choice_on_the_axes_that_is_not_the_strategy_is_refused_before_loading(axes, message):
    from kvlab.config import CacheConfig

    with pytest.raises(ValueError, match=message):
        CacheConfig(**axes)
    assert CacheConfig(name="int4", policy="keep_all", store="contiguous", codec="kivi")


def test_the_attention_backends_a_config_allows_are_the_kernels_own():
    from kvlab.config import ATTENTION_BACKENDS
    from kvlab.kernels.attention import BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS
