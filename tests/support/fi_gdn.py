"""A stand-in for FlashInfer's Gated DeltaNet pool decode (flashinfer.gdn_decode, 0.6.13),
written from its documented semantics and the checks its launcher makes:
gated_delta_rule_decode_pretranspose with q, k [B, 1, H, K] and v [B, 1, HV, V] 16-bit,
A_log fp32, a bf16 pool [slots, HV, V, K] with K contiguous, int32 slot indices, each row's
state read from and written back to its slot, the L2 norms and gates inside."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from helexa.kernels import gated_delta as gd

BF16 = torch.bfloat16


class StandInGdnDecode:
    """FlashInfer's gdn_decode module as documented, in torch; records each call."""

    _GDN_DECODE_BF16_STATE_AVAILABLE = True

    def __init__(self, wrong_slot: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.wrong_slot = wrong_slot  # a broken kernel: writes the slot after the one given

    def gated_delta_rule_decode_pretranspose(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any,
            A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
            scale: float | None = None, output: Any = None, use_qk_l2norm: bool = True,
            initial_state: torch.Tensor | None = None,
            initial_state_indices: torch.Tensor | None = None,
            output_state_indices: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        pool = initial_state
        assert state is None and pool is not None and T == 1
        assert pool.shape[1:] == (HV, V, K) and pool.stride(-1) == 1 and pool.dtype == BF16
        assert K == V == 128 and q.dtype in (torch.float16, BF16) and A_log.dtype == torch.float32
        assert initial_state_indices is not None and initial_state_indices.shape == (B,)
        assert initial_state_indices.dtype == torch.int32
        # its launcher declares each tensor 32-byte aligned (from_dlpack(assumed_align=32))
        assert all(t.is_contiguous() and t.data_ptr() % 32 == 0 for t in (q, k, v, a, b))
        # and their strides those of fresh tensors, as the kernel was first built on (its
        # layout may be static: a size-1 batch's stride included)
        assert all(t.stride() == torch.empty(t.shape).stride() for t in (q, k, v, a, b))
        self.calls.append({"rows": B, "scale": scale, "l2norm": use_qk_l2norm})
        idx = initial_state_indices.long()
        states = pool[idx].transpose(-1, -2).float()  # [B, HV, K, V]
        g = -A_log.exp() * F.softplus(a[:, 0].float() + dt_bias.float())
        beta = b[:, 0].float().sigmoid()
        qf, kf = q[:, 0].float(), k[:, 0].float()
        if use_qk_l2norm:
            qf, kf = gd.l2norm(qf), gd.l2norm(kf)
        group = HV // H
        o = gd.delta_rule_decode((qf * scale).repeat_interleave(group, 1),
                                 kf.repeat_interleave(group, 1), v[:, 0], g, beta, states)
        pool[(idx + 1) % pool.shape[0] if self.wrong_slot else idx] = \
            states.transpose(-1, -2).to(pool.dtype)
        return o[:, None].to(q.dtype), pool
