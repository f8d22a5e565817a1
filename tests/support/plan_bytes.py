"""`helexa plan`'s weight bytes per card for one model entry (the planned-bytes tests)."""

from __future__ import annotations

from helexa.config.schema import load_neuron_config
from helexa.plan import plan_model


def plan_weights(tmp_path, model_dir, kind: str, group: int, dtype: str, tp: int = 1) -> int:
    path = tmp_path / "n.toml"
    path.write_text(f"""
[kv]
kv_budget_mb = 1
[[models]]
id = "tiny"
path = "{model_dir}"
dtype = "{dtype}"
quantize = "{kind}"
quant_group_size = {group}
tp = {tp}
""")
    cfg = load_neuron_config(path)
    return plan_model(cfg, cfg.models[0], path).weight_bytes_per_card
