"""Weight loading: missing tensors are named; each rank reads only its slice."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helexa.neuron.formats.loader import load_model
from helexa.neuron.formats.tensor_map import MissingTensor
from helexa.neuron.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorSlice,
)


def test_missing_tensor_is_named(tmp_path, tiny_model_dir):
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensor, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


class RecordingSlice(TensorSlice):
    """Remembers which index a loader asked for."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self.asked: list = []

    def __getitem__(self, index):
        self.asked.append(index)
        return super().__getitem__(index)


def test_tp_ranks_read_only_their_slices():
    full_q = torch.arange(8 * 4 * 6, dtype=torch.float32).view(32, 6)  # 8 heads × d4, hidden 6
    full_k = -torch.arange(2 * 4 * 6, dtype=torch.float32).view(8, 6)  # 2 kv heads
    for rank in range(2):
        qkv = QKVParallelLinear(6, 4, 8, 2, tp_rank=rank, tp_size=2)
        sl = RecordingSlice(full_q)
        qkv.weight_loader(qkv.weight, sl, "q")
        assert sl.asked == [slice(16 * rank, 16 * rank + 16)]
        qkv.weight_loader(qkv.weight, TensorSlice(full_k), "k")
        torch.testing.assert_close(qkv.weight[16:20], full_k[4 * rank : 4 * rank + 4])


def test_kv_heads_replicate_when_tp_exceeds_them():
    full_k = torch.arange(2 * 4 * 6, dtype=torch.float32).view(8, 6)  # 2 kv heads
    got = []
    for rank in range(4):
        qkv = QKVParallelLinear(6, 4, 8, 2, tp_rank=rank, tp_size=4)
        assert qkv.num_kv_heads == 1
        qkv.weight_loader(qkv.weight, TensorSlice(full_k), "v")
        got.append(qkv.weight[12:16].clone())
    torch.testing.assert_close(got[0], full_k[:4])
    torch.testing.assert_close(got[1], full_k[:4])
    torch.testing.assert_close(got[2], full_k[4:])
    torch.testing.assert_close(got[3], full_k[4:])


def test_row_merged_and_vocab_shards():
    w = torch.randn(6, 10)
    row = RowParallelLinear(10, 6, tp_rank=1, tp_size=2)
    row.weight_loader(row.weight, TensorSlice(w))
    torch.testing.assert_close(row.weight, w[:, 5:])
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=1, tp_size=2)
    merged.weight_loader(merged.weight, TensorSlice(gate), 0)
    merged.weight_loader(merged.weight, TensorSlice(up), 1)
    torch.testing.assert_close(merged.weight, torch.cat([gate[4:], up[4:]]))
    emb = torch.randn(11, 6)  # vocab not divisible by tp: the last rank is padded
    head = ParallelLMHead(11, 6, tp_rank=1, tp_size=2)
    head.weight_loader(head.weight, TensorSlice(emb))
    torch.testing.assert_close(head.weight[:5], emb[6:])
    assert float(head.weight[5].abs().sum()) == 0.0
