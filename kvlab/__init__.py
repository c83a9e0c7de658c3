"""kvlab: KV-cache strategies and weight quantizers behind one inference engine."""

from kvlab.models import load_model

__all__ = ["load_model"]
__version__ = "0.1.0"
