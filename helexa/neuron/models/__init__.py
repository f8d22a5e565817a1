"""Models and their layers (Llama / Qwen2 / Qwen3 dense, the hybrid and MoE families).

Pure modelling on the parallel layers (layers.py); how a checkpoint's weights get into
them, in whatever format, is helexa/neuron/formats/.
"""

from __future__ import annotations

from helexa.neuron.models.config import ModelConfig, UnsupportedArchitecture, parse_model_config

__all__ = ["ModelConfig", "UnsupportedArchitecture", "parse_model_config"]
