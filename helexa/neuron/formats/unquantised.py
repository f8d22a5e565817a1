"""Float safetensors checkpoints: every weight loads as it is stored, into the model's dtype.

No layer gets a method, so each keeps its float weight and the device backend may
pack it for its own matmul (helexa/kernels/backends/); norms fold into the matmuls
they feed (layers.py: RMSNorm.fold_into).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.neuron.formats.base import Checkpoint, asks_quantize
from helexa.neuron.formats.streaming import SafetensorsFormat

if TYPE_CHECKING:
    from helexa.neuron.formats.quantise import QuantSpec


class Unquantised(SafetensorsFormat):
    """A safetensors checkpoint with no quantization_config, and no quantize asked."""

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> Unquantised | None:
        if ckpt.gguf is not None or ckpt.quantization_config or asks_quantize(quantize):
            return None
        return cls(ckpt)
