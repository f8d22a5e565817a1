"""A whole hybrid model on FlashInfer's Gated DeltaNet pool decode (its kernel stood in on
CPU, tests/support/fi_gdn.py): with the states stored V-major for it, prefill (the torch
chunked form over the transposed view), decode rows beside a prefill, and pure decode
steps through the kernel give the torch path's logits, and the runner says which
linear-attention kernels it runs; so do speculative verification rows and their settling
on fla's kernel (tests/support/fla.py) beside it."""

from __future__ import annotations

import pytest
import torch
from support.fi_gdn import StandInGdnDecode

from helexa.fixtures.tiny import init_tiny
from helexa.kernels import flashinfer_gdn as fig
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

UNAVAILABLE = fig.fi_pool_unavailable


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # linear heads of 128 x 128 in bf16: what FlashInfer's bf16-state kernels take
    return init_tiny(tmp_path_factory.mktemp("hybrid128") / "m", arch="qwen3_5",
                     hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=128,
                     intermediate_size=256, num_layers=4, linear_heads=(1, 2),
                     dtype="bfloat16")


def _runner(path) -> ModelRunner:
    return ModelRunner(path, num_blocks=16, block_size=8, max_num_seqs=2,
                       max_batched_tokens=64, num_state_slots=2, backend="torch")


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Slot 0 prefills 9 tokens; then decodes beside slot 1's 5-token prefill; then both
    decode four steps (fixed tokens, so both runners see the same inputs)."""
    a, b = list(range(1, 10)), list(range(20, 25))
    out = [runner.execute([SeqInput(a, 0, [0, 1], True, 0)])]
    out.append(runner.execute([SeqInput([7], 9, [0, 1], True, 0),
                               SeqInput(b, 0, [2, 3], True, 1)]))
    for i in range(4):
        out.append(runner.execute([SeqInput([30 + i], 10 + i, [0, 1], True, 0),
                                   SeqInput([40 + i], 5 + i, [2, 3], True, 1)]))
    return out


def test_a_hybrid_on_the_pool_kernel_gives_the_torch_paths_logits(checkpoint, monkeypatch):
    plain = _runner(checkpoint)
    assert "torch decode" in plain.attention_backend
    want = _steps(plain)
    fake = StandInGdnDecode()
    monkeypatch.setattr(fig, "_fi_gdn", fake)
    monkeypatch.setattr(fig, "fi_pool_unavailable", lambda *a: "")  # as on a Hopper GPU
    fused = _runner(checkpoint)
    assert "FlashInfer pool decode (states in place)" in fused.attention_backend
    assert all(layer.pool is not None for layer in fused.linear_states.layers)
    probes = len(fake.calls)
    got = _steps(fused)
    linear_layers = len(fused.linear_states.layers)
    assert len(fake.calls) - probes == 4 * linear_layers  # the four pure decode steps
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # no pure decode
    for g, w in zip(got[2:], want[2:], strict=True):
        # FlashInfer's kernel hands o back in bf16 (as fla's does), the torch rule in fp32:
        # one rounding of o per layer apart, here 0.07 of the logits' spread at most (with
        # the stand-in's o kept in fp32 the logits are bit for bit the torch path's)
        apart = float((g - w).abs().max())
        assert apart < 0.1 * float(w.std())
        _same_choice(g, w, apart)
    monkeypatch.setattr(fig, "fi_pool_unavailable", UNAVAILABLE)


def _same_choice(got: torch.Tensor, want: torch.Tensor, apart: float) -> None:
    """Each row's greedy token is the reference's, or one the reference has within 2 x
    `apart` of its best: logits that differ by up to `apart` can swap two tokens only that
    close (the random head has such near ties: 0.125 apart, swapped on an AMD EPYC)."""
    for g, w in zip(got, want, strict=True):
        pick = int(g.argmax())
        assert pick == int(w.argmax()) or float(w.max() - w[pick]) <= 2 * apart, \
            (pick, int(w.argmax()), float(w.max() - w[pick]), apart)


def _spec_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Slot 0 prefills 9 tokens; verifies a row of its token and 3 drafts; decodes after 2
    of the 4 stood (the held row settled); verifies again beside slot 1's prefill; decodes
    after all 4 stood beside slot 1's decode; then both decode (fixed tokens throughout)."""
    a, b, t0, t1 = list(range(1, 10)), list(range(20, 25)), [0, 1, 2], [3, 4]
    out = [runner.execute([SeqInput(a, 0, t0, True, 0)])]
    out.append(runner.execute([SeqInput([7, 8, 9, 10], 9, t0, True, 0, num_logits=4)]))
    out.append(runner.execute([SeqInput([11], 11, t0, True, 0)]))
    out.append(runner.execute([SeqInput([12, 13, 14, 15], 12, t0, True, 0, num_logits=4),
                               SeqInput(b, 0, t1, True, 1)]))
    out.append(runner.execute([SeqInput([16], 16, t0, True, 0), SeqInput([40], 5, t1, True, 1)]))
    out.append(runner.execute([SeqInput([17], 17, t0, True, 0), SeqInput([41], 6, t1, True, 1)]))
    return out


def test_verification_on_fla_beside_the_pool_kernel_gives_the_torch_paths_logits(
        checkpoint, monkeypatch):
    """As on a Hopper GPU with fla installed: decode on FlashInfer's pool kernel (states
    V-major), verification rows and their settling on fla's kernel (both stood in) read and
    write the states through the transposed view, and every step's logits are the torch
    path's to bf16 rounding, the same tokens first."""
    from support.fla import StandInRecurrent

    from helexa.kernels import fla_gdn

    want = _spec_steps(_runner(checkpoint))
    monkeypatch.setattr(fig, "_fi_gdn", StandInGdnDecode())
    monkeypatch.setattr(fig, "fi_pool_unavailable", lambda *a: "")
    recurrent = StandInRecurrent()
    monkeypatch.setattr(fla_gdn, "_fla_recurrent", recurrent)
    monkeypatch.setattr(fla_gdn, "fla_decode_available", lambda device: True)
    fused = _runner(checkpoint)
    assert "FlashInfer pool decode" in fused.attention_backend
    assert "verification rows fla, one launch" in fused.attention_backend
    recurrent.calls.clear()  # the load probes'
    got = _spec_steps(fused)
    # per linear layer: two verifications, two settlings (before steps 3 and 5)
    assert sum(c["q"][1] == 4 for c in recurrent.calls) == 4 * len(fused.linear_states.layers)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        apart = float((g - w).abs().max())
        assert apart < 0.1 * float(w.std())
        _same_choice(g, w, apart)
    monkeypatch.setattr(fig, "fi_pool_unavailable", UNAVAILABLE)
