"""config.json parsing: both rope formats, and clear refusals."""

from __future__ import annotations

import json

import pytest

from helexa.neuron.formats.loader import load_model
from helexa.neuron.models import UnsupportedArchitecture, parse_model_config


def test_new_and_legacy_rope_formats_parse_alike(tiny_checkpoint):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    new = json.loads((tiny_checkpoint("qwen3", rope_scaling=scaling) / "config.json").read_text())
    old = json.loads((tiny_checkpoint("qwen3", rope_scaling=scaling, legacy_config=True)
                      / "config.json").read_text())
    assert "rope_parameters" in new and "rope_scaling" in old
    a, b = parse_model_config(new), parse_model_config(old)
    assert a.rope == b.rope
    assert a.rope.rope_type == "yarn" and a.rope.theta == 1000000.0
    assert a.rope.params["factor"] == 4.0


def test_family_switches():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}
    qwen2 = parse_model_config({**base, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = parse_model_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    llama = parse_model_config({**base, "architectures": ["LlamaForCausalLM"],
                                "attention_bias": True, "rope_theta": 500000.0})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    assert llama.qkv_bias and llama.o_bias and llama.rope.theta == 500000.0
    assert llama.head_dim == 16


@pytest.mark.parametrize(("change", "named"), [
    ({"architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_is_refused_naming_it(tmp_path, tiny_model_dir, change, named):
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitecture, match=named):
        load_model(tmp_path)
