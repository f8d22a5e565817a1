"""Model definitions (Llama / Qwen2 / Qwen3 dense families) and checkpoint loading."""

from __future__ import annotations

from helexa.neuron.models.config import ModelConfig, UnsupportedArchitecture, parse_model_config
from helexa.neuron.models.loader import MissingTensor, load_model

__all__ = [
    "MissingTensor",
    "ModelConfig",
    "UnsupportedArchitecture",
    "load_model",
    "parse_model_config",
]
