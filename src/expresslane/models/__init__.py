"""Model runtime: Hugging Face config and safetensors loading, the Llama-family decoder,
attention over the paged KV cache."""

from expresslane.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from expresslane.models.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "load_model"]
