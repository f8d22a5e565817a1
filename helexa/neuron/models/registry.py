"""Which model class serves each architecture (config.json ``architectures[0]``)."""

from __future__ import annotations

import torch
from torch import nn

from helexa.neuron.models.config import ModelConfig, UnsupportedArchitecture
from helexa.neuron.models.hybrid import HybridForCausalLM
from helexa.neuron.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": HybridForCausalLM,
    "Qwen3NextForCausalLM": HybridForCausalLM,
    "Qwen3_5ForCausalLM": HybridForCausalLM,
    "Qwen3_5ForConditionalGeneration": HybridForCausalLM,
    "Qwen3_5MoeForCausalLM": HybridForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": HybridForCausalLM,
}


def build_model(cfg: ModelConfig, *, tp_rank: int, tp_size: int, dtype: torch.dtype,
                device: str | torch.device) -> nn.Module:
    """The model of ``cfg`` with float layers at this rank's size, weights not loaded."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitecture(f"architecture {cfg.architecture!r} is not supported")
    return cls(cfg, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
