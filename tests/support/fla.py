"""A stand-in for flash-linear-attention's fused recurrent kernel on CPU, written from fla's
documented semantics (grouped key heads, value head h reading key head h // (v_heads /
k_heads), state [N, HV, K, V], the optional in-kernel norms and gates): the backend's calls
to it can be checked, and its results compared with the torch path's, where fla cannot run
(tests/kernels/test_gdn_fla.py, the MTP drafter's tests)."""

from __future__ import annotations

from typing import Any

import torch

from helexa.kernels import gated_delta as gd


class StandInRecurrent:
    """fla's fused_recurrent_gated_delta_rule as documented, in torch; records each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
                 output_final_state: bool, use_qk_l2norm_in_kernel: bool = False,
                 use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None, use_beta_sigmoid_in_kernel: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"q": q.shape, "k": k.shape, "v": v.shape, "scale": scale,
                           "state": initial_state.shape, "final": output_final_state,
                           "in_kernel": (use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                         use_beta_sigmoid_in_kernel)})
        group = v.shape[2] // q.shape[2]
        state = initial_state.float().clone()
        if use_gate_in_kernel:  # fla's kernel: g = -exp(A_log) softplus(g + dt_bias)
            assert A_log is not None and dt_bias is not None
            g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias.float())
        if use_beta_sigmoid_in_kernel:
            beta = beta.float().sigmoid()
        out = []
        for t in range(q.shape[1]):  # each value head reads its group's key head
            qt, kt = q[:, t].float(), k[:, t].float()
            if use_qk_l2norm_in_kernel:  # x / sqrt(sum x^2 + 1e-6), then q's scale
                qt, kt = gd.l2norm(qt), gd.l2norm(kt)
            qt = qt.repeat_interleave(group, 1) * scale
            kt = kt.repeat_interleave(group, 1)
            out.append(gd.delta_rule_decode(qt, kt, v[:, t], g[:, t], beta[:, t], state))
        return torch.stack(out, 1).to(v.dtype), state


class StandInChunked:
    """fla's chunk_gated_delta_rule as documented from fla-core 0.5 (grouped key heads:
    q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], state [N, HV, K, V]; with
    ``cu_seqlens`` B is 1 and the N sequences lie back to back, each from its own state), in
    torch; records each call's shapes and offsets."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, *, scale: float, initial_state: torch.Tensor | None,
                 output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
                 cu_seqlens_cpu: torch.Tensor | None = None,
                 chunk_indices: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        cu = None if cu_seqlens is None else cu_seqlens.tolist()
        self.calls.append({"q": q.shape, "k": k.shape, "v": v.shape, "scale": scale, "cu": cu,
                           "cu_cpu": None if cu_seqlens_cpu is None else
                           (cu_seqlens_cpu.device.type, cu_seqlens_cpu.tolist()),
                           "chunks": None if chunk_indices is None else chunk_indices.tolist()})
        assert q.shape[0] == 1 and v.shape[2] % q.shape[2] == 0, "fla takes one sequence here"
        cu = cu or [0, q.shape[1]]
        assert initial_state is None or initial_state.shape[0] == len(cu) - 1
        group = v.shape[2] // q.shape[2]
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
            o, s = gd.delta_rule_chunked(q[0, a:b].float().repeat_interleave(group, 1) * scale,
                                         k[0, a:b].float().repeat_interleave(group, 1),
                                         v[0, a:b].float(), g[0, a:b].float(),
                                         beta[0, a:b].float(),
                                         None if initial_state is None else initial_state[i])
            outs.append(o)
            finals.append(s)
        return torch.cat(outs)[None].to(v.dtype), torch.stack(finals)
