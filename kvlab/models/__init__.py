"""Model definitions (one decoder per family) and weight loading."""

from kvlab.models.config import DecoderConfig
from kvlab.models.llama import Decoder
from kvlab.models.loading import REGISTERED_MODELS, load_model, read_hf_config, resolve_checkpoint

__all__ = [
    "REGISTERED_MODELS",
    "Decoder",
    "DecoderConfig",
    "load_model",
    "read_hf_config",
    "resolve_checkpoint",
]
