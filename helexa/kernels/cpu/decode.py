"""Native CPU decode of a dense decoder (Llama / Qwen2 / Qwen3): helexa/kernels/cpu/native.c
doing everything between the matmuls of a pure-decode step.

Per layer four matmuls (each through its installed kernel) and three native calls
instead of ~40 eager ops; or, when every layer matmul has a native kernel at this
batch size (hx_gemm's panels for float weights, kquant.c's or int8g.c's for quantised
ones: each kernel's ``mat_words``), all layers in one native call (hx_decode_layers).
Applies to fp32 activations and plain fp32 KV at tp = 1; the cpu backend decides when
(helexa/kernels/backends/cpu.py). The model is read, never changed: its structure
(``model.layers[i].self_attn.qkv_proj`` ...) is that of helexa/neuron/models/llama.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from helexa.kernels.paged_kv import PagedKV


def supports(model: Any) -> bool:
    """A dense Llama-shaped decoder whose every layer is attention + gated MLP (a model
    class may say it is not one: ``native_decode = False``)."""
    if not getattr(model, "native_decode", True):
        return False
    try:
        layers = list(model.model.layers)
        return bool(layers) and all(
            hasattr(layer, "self_attn") and hasattr(layer.mlp, "gate_up_proj")
            and hasattr(layer.self_attn, "qkv_proj") for layer in layers)
    except AttributeError:
        return False


class NativeDecode:
    """The per-pool plan (pointers that do not change from step to step) and the step."""

    def __init__(self, model: Any, pools: list[PagedKV], lib: Any) -> None:
        # Any: read as helexa/neuron/models/llama.py lays it out (checked by supports())
        self.model, self.pools, self.lib = model, pools, lib
        self.first_norm, self.layers = self._plan()
        self._fused: dict[int, tuple | None] = {}
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        attn0 = model.model.layers[0].self_attn
        self.heads = (attn0.num_heads, attn0.num_kv_heads, attn0.head_dim)
        self.scale = 1.0 / math.sqrt(attn0.head_dim)
        self.num_slots, self.block_size = pools[0].k_heads.shape[2], pools[0].k_cache.shape[1]
        self.hidden = model.cfg.hidden_size
        self.embed = self._embed_words()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 tables: torch.Tensor, decode_len: int,
                 logits_rows: torch.Tensor | None) -> torch.Tensor:
        model, lib = self.model, self.lib
        b = input_ids.shape[0]
        fused = self._fused_plan(b)
        embed = None
        if fused is not None and self.embed is not None and input_ids.dtype == torch.int64 \
                and input_ids.is_contiguous():
            embed = self.embed  # the rows looked up (and normed) in hx_decode_layers
            x = torch.empty(b, self.hidden, dtype=torch.float32)
        else:
            x = model.model.embed_tokens(input_ids)  # [B, hidden], fresh: updated in place
        hidden = self.hidden
        h, kvh, d = self.heads
        normed, attn_out, qkv, tmp, gate_up, act, work = self._scratch(b, decode_len)
        rotary = (model.rotary.cos.data_ptr(), model.rotary.sin_signed.data_ptr(),
                  positions.data_ptr())
        paging = (tables.data_ptr(), tables.shape[1], self.block_size)
        xp, normed_p = x.data_ptr(), normed.data_ptr()
        if embed is None:
            lib.hx_add_rmsnorm(xp, None, normed_p, self.first_norm[0], b, hidden,
                               self.first_norm[1])
        if fused is not None:  # every matmul native at this batch size: one call for all layers
            plan, eps, inter, head = fused
            logits = None
            if head is not None and logits_rows is None:  # the head's matmul in the same call
                logits = torch.empty(b, head[1], dtype=torch.float32)
            rc = lib.hx_decode_layers(len(plan), plan.data_ptr(), eps.data_ptr(), xp,
                                      normed_p, b, hidden, h, kvh, d, inter, qkv.data_ptr(),
                                      attn_out.data_ptr(), tmp.data_ptr(), gate_up.data_ptr(),
                                      act.data_ptr(), *rotary, self.num_slots, *paging,
                                      self.scale, work.data_ptr(),
                                      None if logits is None else head[0].data_ptr(),
                                      None if logits is None else logits.data_ptr(),
                                      None if embed is None else embed.data_ptr(),
                                      input_ids.data_ptr(), *self.first_norm)
            if rc == -5:
                raise IndexError(f"a token id outside the vocabulary of {int(embed[1])}: "
                                 f"{input_ids.tolist()}")
            if rc != 0:
                raise RuntimeError(f"hx_decode_layers: a matmul refused its shape (code {rc})")
            if logits is not None:
                return logits
        else:  # matmuls through their kernels between the native calls
            context = (self.num_slots, *paging, attn_out.data_ptr(), self.scale, work.data_ptr())
            for qkv_proj, qk_norm, pools, o_proj, post, gate_up, inter, down, nxt in self.layers:
                qkv = qkv_proj(normed)
                lib.hx_attn_decode(qkv.data_ptr(), b, h, kvh, d, *qk_norm, *rotary, *pools,
                                   *context)
                delta = o_proj(attn_out)  # held by name: C reads it after data_ptr()
                lib.hx_add_rmsnorm(xp, delta.data_ptr(), normed_p, post[0], b, hidden, post[1])
                gu = gate_up(normed)
                act = torch.empty(b, inter, dtype=x.dtype)
                lib.hx_silu_mul(gu.data_ptr(), act.data_ptr(), b, inter)
                delta = down(act)
                lib.hx_add_rmsnorm(xp, delta.data_ptr(), normed_p, nxt[0], b, hidden, nxt[1])
        if logits_rows is not None:
            normed = normed.index_select(0, logits_rows)
        return model.lm_head(normed).float()

    def _scratch(self, rows: int, decode_len: int) -> tuple[torch.Tensor, ...]:
        """The step's scratch tensors for ``rows`` rows, kept from step to step (a step reads
        nothing a previous one left there): normed, attn_out, then hx_decode_layers' qkv,
        tmp, gate_up and act, and the attention's work for ``decode_len`` (grown to powers of
        two, as the context grows a token a step)."""
        h, kvh, d = self.heads
        hidden, inter = self.hidden, self.layers[0][6]
        need = (h // kvh) * decode_len + d
        got = self._buffers.get(rows)
        if got is None or got[-1].numel() < need:
            got = tuple(torch.empty(rows, n, dtype=torch.float32) for n in (
                hidden, h * d, (h + 2 * kvh) * d, hidden, 2 * inter, inter)) + (
                torch.empty(1 << (need - 1).bit_length(), dtype=torch.float32),)
            self._buffers[rows] = got
        return got

    def _embed_words(self) -> torch.Tensor | None:
        """hx_decode_layers' EMBED_WORDS for a grouped int8 table of fp32 scales (and zeros)
        on one rank (GGUF's quantised token_embd); None where the embedding
        is another kind (its own lookup runs in Python). The grouped table is known by its
        lookup's ``group`` and its buffers (helexa/neuron/formats/methods.py's Int8gLookup:
        a layer below it does not import it)."""
        emb = self.model.model.embed_tokens
        group = getattr(getattr(emb, "lookup", None), "group", None)
        if not isinstance(group, int) or getattr(emb, "tp_size", 1) != 1 \
                or not hasattr(emb, "qweight") or not hasattr(emb, "qscales"):
            return None
        q, s, z = emb.qweight, emb.qscales, getattr(emb, "qzeros", None)
        if (q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] != self.hidden
                or s.dtype != torch.float32 or s.dim() != 2 or s.shape[1] * group != self.hidden
                or (z is not None and (z.dtype != torch.float32 or z.shape != s.shape))
                or not all(t.is_contiguous() for t in (q, s) + ((z,) if z is not None else ()))):
            return None
        words = [group, q.shape[0], q.data_ptr(), s.data_ptr(),
                 0 if z is None else z.data_ptr()]
        return torch.tensor(words, dtype=torch.int64)

    def _head_alone(self) -> bool:
        """The LM head is its kernel's matmul and nothing more (one rank: no vocab gather)."""
        head = self.model.lm_head
        return getattr(head, "tp_size", 1) == 1 and getattr(head, "bias", None) is None

    def fused(self, rows: int) -> bool:
        """Whether a step of this many rows runs all layers in one native call."""
        return self._fused_plan(rows) is not None

    def _plan(self) -> tuple[tuple, list[tuple]]:
        """The first norm's (weight pointer or None, eps), and per layer its matmul modules,
        (q/k norm weight pointer, eps), its KV pool's pointers and the (pointer, eps) of the
        norms after attention and after the MLP (the next layer's input norm, or the final
        one)."""
        m = self.model.model

        def norm(n: Any) -> tuple[int | None, float]:
            return (None if n.folded else n.weight.data_ptr()), n.eps

        layers = list(m.layers)
        plan = []
        for i, layer in enumerate(layers):
            attn, mlp, pool = layer.self_attn, layer.mlp, self.pools[i]
            qkn = attn.qk_norm_weight
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            plan.append((attn.qkv_proj, (None if qkn is None else qkn.data_ptr(), attn.eps),
                         (pool.k_heads.data_ptr(), pool.v_heads.data_ptr()), attn.o_proj,
                         norm(layer.post_attention_layernorm), mlp.gate_up_proj, mlp.inter,
                         mlp.down_proj, norm(nxt)))
        return norm(layers[0].input_layernorm), plan

    def _fused_plan(self, rows: int) -> tuple | None:
        """hx_decode_layers' plan ([L, 4 * MAT_WORDS + 5] words, [L, 3] eps, intermediate
        size, the LM head's MAT_WORDS words and its N, or None) for a step of ``rows`` rows,
        or None when some layer matmul has no native kernel at that size (each kernel's
        choice is by its own row buckets, so this is kept per row count)."""
        if rows in self._fused:
            return self._fused[rows]

        def words(mod: Any) -> list[int] | None:
            fn = getattr(getattr(mod, "kernel", None), "mat_words", None)
            return None if fn is None else fn(rows, getattr(mod, "bias", None))

        plan, eps, out = [], [], None
        for qkv, (qkn, qk_eps), (k, v), o, post, gate_up, inter, down, nxt in self.layers:
            mats = [words(m) for m in (qkv, o, gate_up, down)]
            if any(m is None for m in mats) or inter != self.layers[0][6]:
                break
            plan.append([w for m in mats if m is not None for w in m]
                        + [qkn or 0, post[0] or 0, nxt[0] or 0, k, v])
            eps.append([qk_eps, post[1], nxt[1]])
        else:
            head = words(self.model.lm_head) if self._head_alone() else None
            out = (torch.tensor(plan, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32),
                   self.layers[0][6], None if head is None else (torch.tensor(head), head[1]))
        self._fused[rows] = out
        return out
