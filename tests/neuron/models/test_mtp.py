"""The MTP head (helexa/neuron/models/mtp.py) computes what its checkpoint describes: against a
plain-torch reference written here from the structure (fc over the normed embedding of
token t + 1 and the normed hidden state at t, one gated full-attention layer with its own
causal KV, MLP or experts, a final norm, the shared lm_head; every norm (1 + w)), on tiny
random Qwen3-Next (expert MLP) and Qwen3.5 (dense MLP) checkpoints, run through the paged
pool in chunks and decode rows over a shuffled block table."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helexa.checkpoint.memory import kv_bytes_per_token
from helexa.checkpoint.shape import read_model_shape
from helexa.cli.plan import format_plan
from helexa.config.schema import load_neuron_config
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
from helexa.plan import plan_model

ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")

def runner_for(model_dir: Path, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                       max_batched_tokens=256, dtype="float32", num_state_slots=4)


# ---------------------------------------------------------------- the reference


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rotate(x: torch.Tensor, pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Rotate the leading `dim` of each head (rotate_half pairs), the rest pass through."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    r, rest = x[..., :dim], x[..., dim:]
    half = torch.cat([-r[..., dim // 2:], r[..., :dim // 2]], -1)
    return torch.cat([r * cos + half * sin, rest], -1)


def reference_mtp(model_dir: Path, tokens_next: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] of the MTP head at positions 0..T-1 of one sequence."""
    raw = json.loads((model_dir / "config.json").read_text())
    c = {**raw, **raw.get("text_config", {})}
    w = load_file(str(model_dir / "model.safetensors"))
    root = "model.language_model." if "text_config" in raw else "model."
    eps, nq, nkv, d = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rope = c["rope_parameters"]
    rot = int(d * rope.get("partial_rotary_factor", 1.0))
    T = len(tokens_next)
    p = "mtp.layers.0."

    emb = w[root + "embed_tokens.weight"][torch.tensor(tokens_next)]
    x = torch.cat([_norm(emb, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ w["mtp.fc.weight"].T
    # attention: q carries [q | gate] per head
    h = _norm(x, w[p + "input_layernorm.weight"], eps)
    qg = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, nq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
    pos = torch.arange(T)
    q = _rotate(_norm(q, w[p + "self_attn.q_norm.weight"], eps), pos, rot, rope["rope_theta"])
    k = _rotate(_norm(k, w[p + "self_attn.k_norm.weight"], eps), pos, rot, rope["rope_theta"])
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + o.reshape(T, nq * d) @ w[p + "self_attn.o_proj.weight"].T
    # MLP: experts (top k of a softmax router, plus a gated shared expert) or dense
    h = _norm(x, w[p + "post_attention_layernorm.weight"], eps)

    def mlp(q: str, y: torch.Tensor) -> torch.Tensor:
        return (F.silu(y @ w[q + "gate_proj.weight"].T) * (y @ w[q + "up_proj.weight"].T)
                ) @ w[q + "down_proj.weight"].T

    if c.get("num_experts"):
        probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
        top, idx = probs.topk(c["num_experts_per_tok"], -1)
        if c.get("norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for t in range(T):
            for j in range(idx.shape[1]):
                out[t] += top[t, j] * mlp(f"{p}mlp.experts.{int(idx[t, j])}.", h[t:t + 1])[0]
        if c.get("shared_expert_intermediate_size"):
            out += torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * mlp(
                p + "mlp.shared_expert.", h)
    else:
        out = mlp(p + "mlp.", h)
    x = _norm(x + out, w["mtp.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("arch", ARCHS)
def test_head_matches_the_reference_through_the_paged_pool(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, mtp=True)
    runner = runner_for(model_dir)
    assert runner.model.mtp is not None
    g = torch.Generator().manual_seed(5)
    T = 23
    tokens = torch.randint(3, 500, (T,), generator=g).tolist()
    hidden = torch.randn(T, runner.model.cfg.hidden_size, generator=g)
    table = list(range(runner.num_blocks))
    random.Random(7).shuffle(table)
    table = table[: -(-T // 4)]
    ours = []
    # a chunk of 9, one of 8 (a prefill over cached context), then decode rows
    for start, end in [(0, 9), (9, 17), *((i, i + 1) for i in range(17, T))]:
        n = end - start
        logits, out = runner.execute_mtp(
            [SeqInput(tokens[start:end], start, table, True, num_logits=n)], hidden[start:end])
        assert out.shape == (n, runner.model.cfg.hidden_size)
        ours.append(logits)
    ref = reference_mtp(model_dir, tokens, hidden)
    torch.testing.assert_close(torch.cat(ours), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_match_the_same_rows_alone(tiny_checkpoint, arch):
    # Two sequences in one step, one decoding and one in prefill, with the output rows
    # handed back in the order given (the runner lays decode rows first).
    model_dir = tiny_checkpoint(arch, mtp=True)
    runner = runner_for(model_dir)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(3, 500, (9,), generator=g).tolist(), torch.randint(3, 500, (6,), generator=g).tolist()
    ha, hb = torch.randn(9, 64, generator=g), torch.randn(6, 64, generator=g)
    ta, tb = [0, 1, 2], [3, 4]
    runner.execute_mtp([SeqInput(a[:8], 0, ta, False)], ha[:8])
    both_logits, both_out = runner.execute_mtp(
        [SeqInput(b, 0, tb, True, num_logits=6), SeqInput(a[8:], 8, ta, True)],
        torch.cat([hb, ha[8:]]))
    ref_a, ref_b = reference_mtp(model_dir, a, ha), reference_mtp(model_dir, b, hb)
    torch.testing.assert_close(both_logits, torch.cat([ref_b, ref_a[8:]]), atol=2e-4, rtol=2e-4)
    assert both_out.shape == (7, 64)


def test_the_pool_holds_the_heads_kv_as_helexa_plan_counts(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    runner = runner_for(model_dir, num_blocks=16)
    shape = read_model_shape(model_dir / "config.json")
    assert shape.mtp_layers == 1
    assert len(runner.kv_pools) == shape.full_attention_layers + 1
    assert runner.kv_bytes_per_block == 4 * kv_bytes_per_token(shape, 1, "fp32", 1)


@pytest.mark.parametrize(("engine", "profile", "layers"), [
    ("mtp", "", 1), ("off", 'speculation = "mtp"', 1), ("ngram", "", 0), ("off", "", 0)])
def test_helexa_plan_counts_the_heads_layer_where_the_config_drafts_with_it(
        tiny_checkpoint, tmp_path, engine, profile, layers):
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    path = tmp_path / "n.toml"
    path.write_text(f'[engine]\nspeculation = "{engine}"\n[kv]\nkv_budget_mb = 4\n'
                    f'[profiles.fast]\n{profile}\n'
                    f'[[models]]\nid = "m"\npath = "{model_dir}"\n')
    cfg = load_neuron_config(path)
    plan = plan_model(cfg, cfg.models[0], path)
    shape = read_model_shape(model_dir / "config.json")
    assert plan.mtp_kv_layers == layers
    assert plan.bytes_per_token == kv_bytes_per_token(shape, 1, "fp32", layers)
    assert ("+ 1 MTP" in format_plan(plan)) == bool(layers)
    # the runner the neuron builds from this plan holds exactly that pool
    runner = ModelRunner(model_dir, num_blocks=8, block_size=plan.block_size, max_num_seqs=2,
                         max_batched_tokens=64, num_state_slots=2, mtp_kv_layers=layers)
    assert runner.kv_bytes_per_block == plan.block_size * plan.bytes_per_token


def test_a_head_declared_but_absent_loads_without_it(tiny_checkpoint, tmp_path, capsys):
    src = tiny_checkpoint("qwen3_5", mtp=True)
    out = tmp_path / "no-mtp-tensors"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
               if not k.startswith("mtp.")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    runner = runner_for(out)
    assert runner.model.mtp is None
    assert "model.mtp_missing" in capsys.readouterr().out
    # the pool is still as planned (plan reads config.json, which declares the head)
    assert len(runner.kv_pools) == 2
