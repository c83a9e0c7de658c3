"""Structured configs of a run, registered in Hydra's ConfigStore. Each dataclass checks
itself in ``__post_init__`` and names the field, the bad value and what is allowed, so a bad
sweep point fails before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from kvlab.kernels.plan import KernelSettings
from kvlab.paths import CONF_DIR
from kvlab.speculative.config import SpecConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


@dataclass
class ModelConfig:
    """``source``: a registered name, a checkpoint directory, a .gguf file or a hub id."""

    source: str = "smollm2-135m"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: CUDA when present
    huge_pages: bool = True  # CPU weights and KV on 2 MiB pages where the OS gives them
    backend: str = "auto"  # native (kvlab's decoder), hf (transformers' class), auto: native
    # where kvlab's decoder knows the architecture

    def __post_init__(self) -> None:
        from kvlab.models.loading import BACKENDS

        _require(bool(self.source), "model.source", self.source, "a non-empty model name or path")
        _require(self.backend in BACKENDS, "model.backend", self.backend, ", ".join(BACKENDS))
        _require(self.dtype in DTYPES, "model.dtype", self.dtype, ", ".join(DTYPES))
        _require(self.device in DEVICES, "model.device", self.device, ", ".join(DEVICES))


@dataclass
class CacheConfig:
    """``name`` of a registered strategy; ``policy``/``store``/``codec``: its choice on the
    three axes (as its yaml names them; "" = the strategy's), checked before anything
    loads; every key of ``options`` is an option of that strategy."""

    name: str = "full"
    policy: str = ""
    store: str = ""
    codec: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvlab.cache import registered
        from kvlab.cache.base import cache_options
        from kvlab.cache.composed import check_axes

        known = registered()
        _require(self.name in known, "cache.name", self.name, ", ".join(sorted(known)))
        check_axes(self.name, policy=self.policy, store=self.store, codec=self.codec)
        cache_options(self.name, self.options)  # the strategy checks its own options


@dataclass
class QuantConfig:
    """``name`` of a registered weight quantizer (``none``: full precision); every other key
    is an option of that quantizer."""

    name: str = "none"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvlab.quant import quant_options

        quant_options(self.name, self.options)  # names the bad field, value and what is allowed


@dataclass
class LengthConfig:
    """A token-count distribution of a serving trace (see :class:`LengthDistribution`)."""

    kind: str = "fixed"
    value: int = 128
    low: int = 1
    high: int = 1024
    sigma: float = 1.0


PREEMPTIONS = ("swap", "recompute")


@dataclass
class ConversationConfig:
    """Multi-turn conversations (SCBench's shared context, arXiv 2412.10319): ``turns``
    questions over one document of ``document_len`` tokens of WikiText-2, each question
    ``question_len`` tokens and its answer ``answer_len`` generated tokens; a turn's prompt
    is the whole conversation so far (document, earlier questions and answers, its
    question) and it arrives ``think_s`` after the previous answer ended. ``turns=0``: no
    conversations (the serving trace)."""

    turns: int = 0
    document_len: int = 2048
    question_len: int = 32
    answer_len: int = 32
    think_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("turns", "document_len", "question_len", "answer_len"):
            low = 0 if name == "turns" else 1
            value = getattr(self, name)
            _require(value >= low, f"workload.serving.conversation.{name}", value, f">= {low}")
        _require(self.think_s >= 0, "workload.serving.conversation.think_s", self.think_s, ">= 0")

    def longest(self) -> int:
        """Tokens of a conversation's last turn, its answer included."""
        return self.document_len + self.turns * (self.question_len + self.answer_len)


@dataclass
class ServingConfig:
    """``workload.kind=serving``: ``num_requests`` requests arriving at ``rate`` per second
    (Poisson; 0: all at t=0), each ``shared_prefix`` tokens of system prompt and a prompt
    of ``prompt_len`` tokens of WikiText-2, generating ``output_len`` tokens; the cache may
    hold ``kv_budget_bytes`` (or ``kv_budget_gib``); a joining request feeds ``chunk``
    prompt tokens per step at most, and a step feeds ``max_batched_tokens`` tokens in all,
    the running batch's decode tokens first (vLLM's ``max_num_batched_tokens``; 0: no step
    budget); a preempted request's blocks are kept for its return (``preemption=swap``: in
    the pool while it does not need their room, then in a tiered store's slow tier) or
    forgotten (``recompute``); ``max_running`` caps the batch (0: the budget does); a group
    of up to ``max_joining`` requests is admitted together (1: each request alone, no
    padding between prompts of different lengths in its attention; 0: as many as the
    budgets allow)."""

    num_requests: int = 32
    rate: float = 0.0
    prompt_len: LengthConfig = field(
        default_factory=lambda: LengthConfig("longtail", 256, 32, 1024, 0.8)
    )
    output_len: LengthConfig = field(
        default_factory=lambda: LengthConfig("longtail", 64, 8, 256, 0.8)
    )
    shared_prefix: int = 0
    kv_budget_bytes: int = 0
    kv_budget_gib: float = 0.0
    chunk: int = 256
    max_running: int = 0
    max_joining: int = 1
    max_batched_tokens: int = 2048
    preemption: str = "swap"
    conversation: ConversationConfig = field(default_factory=ConversationConfig)

    def __post_init__(self) -> None:
        _require(self.num_requests >= 1, "workload.serving.num_requests", self.num_requests, ">= 1")
        _require(self.rate >= 0, "workload.serving.rate", self.rate, ">= 0 (0: all at t=0)")
        _require(
            self.shared_prefix >= 0, "workload.serving.shared_prefix", self.shared_prefix, ">= 0"
        )
        _require(self.chunk >= 1, "workload.serving.chunk", self.chunk, ">= 1")
        _require(self.max_running >= 0, "workload.serving.max_running", self.max_running, ">= 0")
        _require(self.max_joining >= 0, "workload.serving.max_joining", self.max_joining, ">= 0")
        _require(
            self.max_batched_tokens >= 0,
            "workload.serving.max_batched_tokens",
            self.max_batched_tokens,
            ">= 0 (0: no step budget)",
        )
        _require(self.preemption in PREEMPTIONS, "workload.serving.preemption", self.preemption,
                 ", ".join(PREEMPTIONS))  # fmt: skip
        budgets = (self.kv_budget_bytes > 0) + (self.kv_budget_gib > 0)
        _require(
            budgets == 1 and self.kv_budget_bytes >= 0 and self.kv_budget_gib >= 0,
            "workload.serving.kv_budget_bytes/kv_budget_gib",
            (self.kv_budget_bytes, self.kv_budget_gib),
            "exactly one of them > 0",
        )
        for name in ("prompt_len", "output_len"):
            try:
                self.distribution(name)
            except ValueError as exc:
                raise ValueError(f"workload.serving.{name}: {exc}") from None

    @property
    def budget_bytes(self) -> int:
        return self.kv_budget_bytes or int(self.kv_budget_gib * 2**30)

    def distribution(self, name: str):
        from kvlab.serving.trace import LengthDistribution

        c = getattr(self, name)
        return LengthDistribution(c.kind, c.value, c.low, c.high, c.sigma)

    def trace_config(self, seed: int):
        from kvlab.serving.trace import TraceConfig

        return TraceConfig(
            self.num_requests, self.rate, self.distribution("prompt_len"),
            self.distribution("output_len"), self.shared_prefix, seed,
        )  # fmt: skip

    def longest_request(self) -> int:
        """Tokens of the longest request the trace can hold (prefix + prompt + output)."""
        if self.conversation.turns:
            return self.conversation.longest()
        lengths = [self.distribution(n).largest for n in ("prompt_len", "output_len")]
        return self.shared_prefix + sum(lengths)


WORKLOADS = ("generate", "serving")


@dataclass
class WorkloadConfig:
    """``kind=generate``: a batch of prompts of exactly ``prompt_len`` tokens of real text
    (or ``prompt_file``) generated together; ``kind=serving``: a request trace served with
    continuous batching under a KV budget (``serving``)."""

    kind: str = "generate"
    serving: ServingConfig | None = None

    prompt_len: int = 512
    new_tokens: int = 64
    batch_size: int = 1
    prompt_file: str | None = None
    prefill_chunk: int = 0  # 0: whole prompt in one pass
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_on_eos: bool = False  # benchmarks decode exactly new_tokens by default
    warmup: bool = True

    def __post_init__(self) -> None:
        _require(self.kind in WORKLOADS, "workload.kind", self.kind, str(WORKLOADS))
        _require(
            (self.kind == "serving") == (self.serving is not None),
            "workload.serving",
            self.serving,
            "options exactly when workload.kind=serving (use workload=serving)",
        )
        for name in ("prompt_len", "new_tokens", "batch_size"):
            value = getattr(self, name)
            _require(value >= 1, f"workload.{name}", value, "an integer >= 1")
        _require(
            self.prefill_chunk >= 0,
            "workload.prefill_chunk",
            self.prefill_chunk,
            "0 (one pass) or a chunk size >= 1",
        )
        _require(self.temperature >= 0, "workload.temperature", self.temperature, ">= 0")
        _require(self.top_k >= 0, "workload.top_k", self.top_k, ">= 0 (0 = off)")
        _require(0 < self.top_p <= 1, "workload.top_p", self.top_p, "0 < top_p <= 1")
        if self.prompt_file is not None:
            exists = Path(self.prompt_file).expanduser().is_file()
            _require(exists, "workload.prompt_file", self.prompt_file, "an existing text file")


# kvlab.kernels.attention.BACKENDS (spelled out here so the config needs no torch import)
ATTENTION_BACKENDS = ("auto", "c", "gpu", "flex", "triton", "reference")


@dataclass
class EngineConfig:
    """How steps run. ``compile`` puts each decode step under ``torch.compile`` (inductor on
    the CPU, CUDA graphs on a GPU; the cache keeps static shapes): ``true``, ``false`` or
    ``auto`` — eager on the CPU, where kvlab's fused C decode layer runs, compiled on CUDA
    (with ``autotune``: whichever a timing in this process says wins; see
    kvlab.engine.compile_choice). ``attention``: the decode attention backend, ``auto`` =
    the C kernel on the CPU, FlexAttention and Triton on CUDA (see kvlab.kernels.attention);
    pinning one compares backends on one machine. ``linear``, ``wide_linear``,
    ``gemv_order`` and ``autotune``: the kernel plan's settings (:class:`KernelSettings`)."""

    compile: Any = "auto"  # true, false or auto
    attention: str = "auto"
    linear: str = "auto"
    wide_linear: str = "auto"
    gemv_order: str = "auto"
    autotune: bool = False

    def __post_init__(self) -> None:
        allowed = "true, false or auto"
        _require(self.compile in (True, False, "auto"), "engine.compile", self.compile, allowed)
        allowed = ", ".join(ATTENTION_BACKENDS)
        _require(self.attention in ATTENTION_BACKENDS, "engine.attention", self.attention, allowed)
        self.kernel_settings()  # checks its fields

    def kernel_settings(self) -> KernelSettings:
        return KernelSettings(self.linear, self.wide_linear, self.gemv_order, self.autotune)


LOGGERS = ("none", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    """Where a run's record also goes: ``none``, or W&B (offline by default: no account)."""

    name: str = "none"
    project: str = "kvlab"
    entity: str | None = None
    mode: str = "offline"

    def __post_init__(self) -> None:
        _require(self.name in LOGGERS, "logger.name", self.name, ", ".join(LOGGERS))
        _require(self.mode in WANDB_MODES, "logger.mode", self.mode, ", ".join(WANDB_MODES))


@dataclass
class RunConfig:
    """One point of a study: model × quant × cache × workload (+ evals) → ``result.json``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding
    eval: dict[str, Any] = field(default_factory=dict)  # eval name -> its options
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    threads: int = 0  # 0: the CPUs this process was given (kvlab.threads)
    resume: bool = True  # skip a point whose result.json says ok for the same config

    def __post_init__(self) -> None:
        _require(self.threads >= 0, "threads", self.threads, "0 (default) or a count >= 1")
        _require(
            not (self.engine.compile is True and self.workload.kind == "serving"),
            "engine.compile",
            self.engine.compile,
            "false with workload=serving (the running batch changes size every few steps, "
            "so each size would compile anew)",
        )
        _require(
            not (self.spec.drafts_with_a_model and self.workload.kind == "serving"),
            "spec.method",
            self.spec.method,
            "none or ngram with workload=serving (a draft model's cache follows offline "
            "rounds only so far)",
        )
        from kvlab.eval import eval_options

        for name, options in self.eval.items():
            eval_options(name, options)  # each eval checks its own options


def check_backend(cfg: RunConfig, options: Any) -> str:
    """The backend ``cfg``'s model runs under (``model.backend`` resolved: native or hf),
    once, from configs alone, it is known to serve the run's strategy with ``options``
    (its checked options); a refusal raises with the reason."""
    from kvlab.models.loading import backend_refusal, resolve_backend

    backend = resolve_backend(cfg.model.source, cfg.model.backend)
    refused = backend_refusal(cfg.model.source, backend, cfg.cache.name, options)
    if refused:
        raise ValueError(refused)
    return backend


def check_context(cfg: RunConfig) -> None:
    """Fail early, with no weights loaded, when what the run feeds the model (prompt + new
    tokens, each eval's windows) exceeds its trained context — unless the cache strategy
    keeps positions within it (StreamingLLM-style) — or exceeds the sliding window it was
    trained with (kvlab's decoder attends over the whole context, which past that window
    would be a different model than the checkpoint's)."""
    from kvlab.cache import registered
    from kvlab.cache.base import cache_options
    from kvlab.eval import eval_options
    from kvlab.models.loading import max_context, trained_window

    limit, window = max_context(cfg.model.source), trained_window(cfg.model.source)
    strategy = registered()[cfg.cache.name]
    options = cache_options(cfg.cache.name, cfg.cache.options)
    if check_backend(cfg, options) == "hf":
        window = None  # transformers' classes keep each layer's window (cache/layered.py)
    span = strategy.position_span(options)
    demands = []
    if cfg.workload.serving is not None:
        serving = cfg.workload.serving
        demands.append(("the longest workload.serving request", serving.longest_request()))
    elif cfg.workload.prompt_file is None:
        w = cfg.workload
        field = f"workload.prompt_len={w.prompt_len} + workload.new_tokens={w.new_tokens}"
        demands.append((field, w.prompt_len + w.new_tokens))
    for name, options in cfg.eval.items():
        demand = getattr(eval_options(name, options), "context_demand", None)
        demands += [demand()] if demand else []
    if cfg.spec.enabled and demands:
        from kvlab.engine.generate import check_rollback

        check_rollback(strategy, options, demands[0][1], cfg.spec)
        if cfg.spec.drafts_with_a_model:  # the draft's own cache rolls back too
            spec = cfg.spec
            draft = cache_options(spec.cache, spec.cache_options)
            check_rollback(registered()[spec.cache], draft, demands[0][1], spec, "spec.cache")
    for field, tokens in demands:
        if tokens > limit and (span is None or span > limit):
            raise ValueError(
                f"{field} = {tokens} tokens exceeds the context of model="
                f"{cfg.model.source!r}; allowed: a total <= {limit}"
            )
        if window and tokens > window:
            raise ValueError(
                f"{field} = {tokens} tokens exceeds the {window}-token sliding window "
                f"model={cfg.model.source!r} was trained with, which kvlab's decoder does "
                f"not apply; allowed: a total <= {window}"
            )


def to_run_config(cfg: Any) -> RunConfig:
    """A composed Hydra config as a checked :class:`RunConfig` (every ``__post_init__``
    runs); merged onto the schema first, since a ``_global_`` experiment file can leave the
    root untyped."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))


def registered_names(registry: str) -> str:
    """Every name ``registry`` holds, comma-separated: ``${registered:scorers}`` in a sweep's
    params sweeps them all, so a study's list is the registry's (a scorer added as one file
    joins it). Registries: ``scorers`` (eviction), ``caches`` (strategies), ``quantizers``."""
    from kvlab.cache import registered
    from kvlab.cache.evict.scorers import scorers
    from kvlab.quant import registered_quantizers

    names = {"scorers": scorers, "caches": registered, "quantizers": registered_quantizers}
    if registry not in names:
        raise ValueError(f"${{registered:{registry}}}: allowed: {', '.join(names)}")
    return ",".join(sorted(names[registry]()))


#: option dicts any key may be set in (a preset's yaml lists only the options it changes):
#: an unknown key then fails the options check, which names the field, the value and what
#: is allowed, instead of Hydra's "not in struct"
OPEN_OPTIONS = ("cache.options", "quant.options", "spec.cache_options", "spec.quant_options")


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (conf/config.yaml extends ``run_schema``, its
    option dicts open to any key: :data:`OPEN_OPTIONS`), a
    ``cache`` / ``quant`` group entry for every registered strategy / quantizer that has no
    yaml of its own in ``conf/cache/`` / ``conf/quant/`` (so ``cache=<name>`` composes with
    its defaults: a method is one file),
    and the ``registered`` resolver, which a config reads registries with."""
    from omegaconf import OmegaConf

    from kvlab.cache import registered
    from kvlab.quant import registered_quantizers

    schema = OmegaConf.structured(RunConfig)
    for path in OPEN_OPTIONS:
        OmegaConf.set_struct(OmegaConf.select(schema, path), False)
    store = ConfigStore.instance()
    store.store(name="run_schema", node=schema)
    for group, names in (("cache", registered()), ("quant", registered_quantizers())):
        with_yaml = {path.stem for path in (Path(CONF_DIR) / group).glob("*.yaml")}
        for name in sorted(set(names) - with_yaml):
            store.store(group=group, name=name, node={"name": name, "options": {}})
    if not OmegaConf.has_resolver("registered"):
        OmegaConf.register_new_resolver("registered", registered_names)


register_configs()  # importing the schemas makes them composable (conf/config.yaml needs them)
