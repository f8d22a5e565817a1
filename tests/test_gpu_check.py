"""bench/gpu_check.sh's dry run: every stage of the prepared GPU check runs on CPU and
reports, so the script cannot rot where no GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_reports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: 6/6 stages ok" in proc.stdout
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert report["dry_run"] is True
    assert list(stages) == ["env", "compile", "parity", "decode", "profile", "ttft"]
    assert all(s["ok"] for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    for name in ("dense", "hybrid"):
        parity = stages["parity"][name]
        assert parity["gqa_group"] == 6 and parity["match"], parity
    for name in ("dense_big", "hybrid"):
        for batch in ("batch1", "batch8"):
            assert 0 < stages["decode"][name][batch]["roofline_fraction"]
        assert stages["profile"][name]["kernels_per_step"] > 0
        assert "host_syncs_per_step" in stages["profile"][name]
    assert stages["ttft"]["prompt_tokens"] == 256 and stages["ttft"]["ttft_s"] > 0
    assert stages["compile"]["first_load_s"] > 0
