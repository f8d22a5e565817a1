"""bench/gpu_check.sh's dry run: every stage of the prepared GPU check runs on CPU and
reports, so the script cannot rot where no GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One dry run of every stage, its report's path and its stdout; the tests below read
    it rather than each running the stages again (about 30 s of CPU alone)."""
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    # lookahead left to its default, which the report states (off on a CPU)
    env = {k: v for k, v in os.environ.items() if k != "HELEXA_LOOKAHEAD"}
    # the script's own bound (8 min, no stage started in its last) widened with the test's:
    # a box loaded by other work once took the dry run past 400 s
    env.update(PYTHON=sys.executable, HELEXA_CHECK_SECS="1200")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_the_dry_run_reports_every_stage(whole_run: tuple[Path, str]) -> None:
    out, stdout = whole_run
    assert "gpu_check: 10/10 stages ok" in stdout
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert report["dry_run"] is True
    assert list(stages) == ["env", "compile", "parity", "decode", "profile", "ttft",
                            "spec_vision", "compare", "int8g", "widen"]
    assert all(s["ok"] for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    for name in ("dense", "hybrid"):
        parity = stages["parity"][name]
        assert parity["gqa_group"] == 6 and parity["match"], parity
        assert parity["transformers_eager_vs_sdpa_divergence"] is None, parity
    mtp = stages["spec_vision"]["mtp"]  # speculation with an MTP head, through the engine
    assert all(len(mtp[k]["tokens"]) == 8 for k in ("plain", "drafting", "probes")), mtp
    assert mtp["drafting"]["drafted"] > 0 and mtp["probes"]["followed_steps"] > 0, mtp
    assert "first_divergence" in mtp["probes"], mtp
    vision = stages["spec_vision"]["vision"]  # a prompt with an image, against transformers
    assert vision["image_tokens"] > 0 and vision["match"], vision
    # each big model loaded once, by the decode stage, for the profile and ttft stages too
    assert {k: report["stage_loads"][k] for k in ("decode", "profile", "ttft")} == {
        "decode": {"dense_big": 1, "hybrid_big": 1}, "profile": {}, "ttft": {}}
    for name in ("dense_big", "hybrid_big"):
        assert stages["decode"][name]["load_s"] > 0
        verify = stages["decode"][name]["verify_batch1"]  # a row of 1 + 3 drafts, vs decode
        assert verify["drafts"] == 3 and verify["verify_vs_decode"] > 0, verify
        assert "host_syncs_per_verify_step" in verify, verify
        for batch in ("batch1", "batch8"):
            assert 0 < stages["decode"][name][batch]["roofline_fraction"]
        assert stages["compare"][name]["fused_vs_torch_norms_batch1"] > 0
        engine = stages["decode"][name]["engine_batch1"]  # through EngineCore, both ways
        assert engine["lookahead_by_default"] is False, engine  # CPU: off unless asked
        assert engine["lookahead"]["tok_s"] > 0 and engine["sync"]["tok_s"] > 0, engine
        assert engine["lookahead_vs_sync"] > 0
        assert engine["match"] is True, engine  # lookahead's greedy tokens are the sync run's
        assert stages["profile"][name]["kernels_per_step"] > 0
        assert "host_syncs_per_step" in stages["profile"][name]
        assert stages["profile"][name]["wall_us_per_step"] > 0
        host = stages["profile"][name]["host_us_per_step"]
        parts = {"prepare", "attention_plan", "forward_or_replay", "read_tokens", "other"}
        assert parts | ({"state_plan"} if name == "hybrid_big" else set()) == \
            set(host) - {"step_wall"}, host
        assert host["step_wall"] >= host["forward_or_replay"] > 0 and host["prepare"] > 0
    constrained = stages["decode"]["dense_big"]["engine_constrained"]  # a JSON schema
    assert constrained["match"] is True, constrained  # lookahead's tokens are the sync's
    assert constrained["lookahead"]["tokens"] == constrained["sync"]["tokens"] > 1, constrained
    int8_kv = stages["compare"]["dense_big"]["int8_kv"]  # an int8 pool, both decode paths
    assert int8_kv["triton_vs_torch_path_batch1"] > 0, int8_kv
    for path in ("triton", "torch_path"):
        assert int8_kv[path]["kv_dtype"] == "int8", int8_kv
        assert all(int8_kv[path][b]["roofline_fraction"] > 0 for b in ("batch1", "batch8"))
    assert stages["ttft"]["prompt_tokens"] == 256 and stages["ttft"]["ttft_s"] > 0
    env = stages["env"]  # what the one GPU shot needs to read its figures by
    assert env["versions"]["triton"] and "nvidia-cutlass-dsl" in env["versions"]
    assert env["scratch"]["path"] and env["scratch"]["why"]
    assert stages["compile"]["first_load_s"] > 0
    int8g = stages["int8g"]  # the Triton kernel (interpreted here) beside the tiles
    assert int8g["unavailable"] == "" and int8g["shape"] == [256, 1024], int8g
    paths = ("tiles", "bf16_linear", "triton", "row_torch_op", "row_triton")  # row: per-row
    for rows in ("rows1", "rows8", "rows32"):
        assert set(int8g[rows]) == {*paths, "triton_vs_tiles", "triton_vs_bf16_linear",
                                    "row_triton_vs_row_torch_op"}, int8g
        assert all(int8g[rows][p]["us"] > 0 for p in paths), int8g
    for rows in ("rows1", "rows8", "rows512"):  # int4: helexa's, torch's op alone, bf16
        got = int8g["int4"][rows]
        assert all(got[p]["us"] > 0 for p in ("helexa", "torch_op", "bf16_linear")), got
        assert got["helexa_vs_torch_op"] > 0 and got["helexa_vs_bf16_linear"] > 0, got
        assert got["torch_op_vs_bf16_linear"] > 0, got
    moe = int8g["moe"]  # the routed MoE kernel (interpreted) beside the gathered copies
    for kind in ("bf16", "int8"):  # (int4's CUDA packing: on a GPU only)
        for tokens in (1, 2):  # (1 and 8 on a GPU)
            got = moe[f"{kind}_tokens{tokens}"]
            assert got["routed"]["us"] > 0 and got["gathered"]["us"] > 0, got
            assert got["routed_vs_gathered"] > 0, got
    widen = stages["widen"]  # widened in place through the engine, then a widen refused
    assert all(widen["checks"].values()) and "failed" not in widen, widen["checks"]
    assert widen["rows_before"] == 2 and widen["graphs"] == (
        "off on cpu: none captured, the steps run eagerly"), widen
    widened = widen["widened"]
    assert (widened["answer"], widened["rows_after"], widened["tokens_after"]) == (
        "ok", 5, 128), widened
    assert widened["captured_after"] == [] and widened["reserved_after"] is None, widened
    tokens = widen["tokens"]  # 5 rows of 4 greedy tokens: as a fresh load at that width,
    assert [len(r) for r in tokens["wide"]] == [4] * 5 and tokens["wide"] == tokens["eager"]
    assert tokens["wide"][:2] == tokens["old"]  # and as the 2 rows decoded before the widen
    failure = widen["failure"]  # a step the (stand-in) card cannot hold: the width kept
    assert failure["answer"] == ("re-planning the pool failed: RuntimeError: out of memory: "
                                 "the dry run's stand-in card holds a step of 512 tokens, "
                                 "not 65536"), failure
    assert (failure["rows_after"], failure["tokens_after"]) == (5, 128), failure
    assert tokens["after_failure"] == tokens["wide"], tokens


def test_a_second_run_takes_the_stages_a_first_one_left(tmp_path: Path, capsys: Any,
                                                        whole_run: tuple[Path, str]) -> None:
    """--stages runs a subset in the usual order (what a run cut short by its budget did
    not reach), compare beside a first run's decode figures; a subset the check cannot run
    is refused with the reason."""
    out = tmp_path / "some.json"
    env = dict(os.environ, PYTHON=sys.executable)
    first, _ = whole_run
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out",
                           str(out), "--stages", "compare,env", "--decode-from", str(first)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: 2/2 stages ok" in proc.stdout
    stages = json.loads(out.read_text())["stages"]
    assert list(stages) == ["env", "compare"]
    compare = stages["compare"]
    assert compare["dense_big"]["fused_vs_torch_norms_batch1"] > 0, compare
    # refused before anything runs (in this process: no interpreter started for each)
    gc = _gpu_check()
    for stages, why in (("compare", "add decode"), ("decode,speed", "unknown stage(s) speed"),
                        ("compare --decode-from " + str(out), "no decode figures there")):
        stages, *more = stages.split(" ", 1)
        with pytest.raises(SystemExit) as refused:
            gc.main(["--out", str(tmp_path / "no.json"), "--stages", stages,
                     *(more[0].split() if more else [])])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and why in err, err
    assert not (tmp_path / "no.json").exists()


def _gpu_check() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_the_checkpoints_go_where_the_big_ones_fit(tmp_path: Path, monkeypatch: Any) -> None:
    """The two whole 8B-class checkpoints take ~33 GB: where the temporary folder's disk is
    short of that, the run makes them in memory-backed /dev/shm if it holds them, rather
    than failing every stage that needs them; HELEXA_CHECK_SCRATCH names a folder outright;
    the env stage reports what was found."""
    import shutil
    from types import SimpleNamespace

    gc = _gpu_check()
    disk, shm = tmp_path / "disk", tmp_path / "shm"
    disk.mkdir()
    shm.mkdir()
    room = {str(disk): 20 * 10**9, str(shm): 100 * 10**9}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=room[str(p)]))
    monkeypatch.setattr(gc.tempfile, "gettempdir", lambda: str(disk))
    monkeypatch.delenv("HELEXA_CHECK_SCRATCH", raising=False)
    where, said = gc.scratch_folder(gc.SCRATCH_BYTES, [str(shm)])
    assert where == str(shm) and said["free_gb"] == {str(disk): 20.0, str(shm): 100.0}
    assert said["why"] == f"{disk} has 20.0 GB free, 40 GB wanted"
    assert gc.scratch_folder(10 * 10**9, [str(shm)])[0] == str(disk)  # it fits: no move
    room[str(shm)] = 30 * 10**9  # neither holds it: the roomier
    assert gc.scratch_folder(gc.SCRATCH_BYTES, [str(shm)]) == (str(shm), {
        "path": str(shm), "free_gb": {str(disk): 20.0, str(shm): 30.0},
        "why": "no folder holds it: the largest"})
    monkeypatch.setenv("HELEXA_CHECK_SCRATCH", str(tmp_path))
    assert gc.scratch_folder(gc.SCRATCH_BYTES, [str(shm)])[0] == str(tmp_path)


def test_one_models_failure_leaves_the_others_figures() -> None:
    gc = _gpu_check()

    def measure(name: str) -> dict[str, Any]:
        if name == "hybrid_big":
            raise RuntimeError("Gated DeltaNet kernel failed")
        return {"tok_s": 1.0}

    out = gc.each_model(("dense_big", "hybrid_big"), measure, {"copy_bandwidth_gbs": 4.0})
    assert out["dense_big"] == {"tok_s": 1.0} and out["copy_bandwidth_gbs"] == 4.0
    assert out["hybrid_big"]["error"] == "RuntimeError: Gated DeltaNet kernel failed"
    assert out["failed"] == ["hybrid_big"]


def test_the_held_runners_go_to_ttft_unwrapped_and_are_closed_by_the_end(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The big models' runners the profile stage shares with ttft (the whole dry run
    checks decode loads them for both) reach ttft without the profile's timing wrappers,
    each loaded once (the report's ``loads_s`` counts each load), and every runner loaded
    is closed by the end of the run."""
    gc = _gpu_check()
    closed: list[str] = []
    real_close = gc.Runner.close

    def close(self: Any) -> None:
        closed.append(self.name)
        real_close(self)

    wrapped: list[str] = []
    real_ttft = gc.stage_ttft

    def ttft(ctx: Any) -> dict[str, Any]:  # the profile stage's timing wrappers taken off
        r = ctx.held["dense_big"]
        wrapped.extend(k for k in ("_prepare", "plan", "run")
                       if k in vars(r.runner) or k in vars(r.runner.backend.attention)
                       or k in vars(r.runner.backend.executor))
        return real_ttft(ctx)

    monkeypatch.setattr(gc.Runner, "close", close)
    monkeypatch.setattr(gc, "stage_ttft", ttft)
    report = gc.run(True, tmp_path / "r.json", 400.0, ("profile", "ttft"))
    assert all(report["stages"][k]["ok"] for k in ("profile", "ttft")), report
    assert {k: len(v) for k, v in report["loads_s"].items()} == {"dense_big": 1,
                                                                 "hybrid_big": 1}
    assert sorted(closed) == ["dense_big", "hybrid_big"] and wrapped == []
    assert report["stages"]["profile"]["dense_big"]["host_us_per_step"]["prepare"] > 0


def test_a_stage_is_on_record_before_it_runs_and_models_are_made_when_asked(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A stage the time bound kills mid-way leaves "never finished" in the report (written
    before it starts), and a checkpoint is made only when a stage asks for it."""
    gc = _gpu_check()
    out = tmp_path / "r.json"
    seen: dict[str, Any] = {}

    def stage(ctx: dict[str, Any]) -> dict[str, Any]:
        seen["on_disk"] = json.loads(out.read_text())["stages"]["ttft"]
        ctx["dense"]  # the small dense checkpoint, made now
        return {"failed": ["dense"]}

    monkeypatch.setattr(gc, "stage_ttft", stage)
    report = gc.run(True, out, 400.0, ("ttft",))
    assert seen["on_disk"]["ok"] is False
    assert "never finished (killed at the time bound?)" in seen["on_disk"]["error"]
    assert list(report["models_s"]) == ["dense"]  # no big model was made
    assert report["stages"]["ttft"]["ok"] is False  # a failed model fails the stage


def test_a_stage_killed_at_the_time_bound_keeps_each_model_it_measured(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The time bound's SIGTERM ends the run mid-stage: the models the stage had measured
    are on record (each_model writes them as it goes), the stage still says it never
    finished, and the checkpoints' temporary folder is gone."""
    import signal

    gc = _gpu_check()
    out = tmp_path / "r.json"
    folders: list[Path] = []

    def stage(ctx: dict[str, Any]) -> dict[str, Any]:
        folders.append(ctx.root)

        def measure(name: str) -> dict[str, Any]:
            if name == "hybrid_big":  # the bound strikes while the second model runs
                os.kill(os.getpid(), signal.SIGTERM)
            return {"tok_s": 1.0}

        return gc.each_model(("dense_big", "hybrid_big"), measure, {})

    monkeypatch.setattr(gc, "stage_decode", stage)
    old = signal.getsignal(signal.SIGTERM)
    try:
        gc.exit_on_sigterm()  # as main does
        with pytest.raises(SystemExit):
            gc.run(True, out, 400.0, ("decode",))
    finally:
        signal.signal(signal.SIGTERM, old)
    decode = json.loads(out.read_text())["stages"]["decode"]
    assert decode["ok"] is False and "never finished" in decode["error"]
    assert decode["partial"] == {"dense_big": {"tok_s": 1.0}}
    assert folders and not folders[0].exists()


def test_the_widen_stage_fails_a_gpu_record_that_kept_memory_or_decoded_otherwise(
        tmp_path: Path) -> None:
    """What the widen stage checks on a GPU, which the dry run cannot reach: graphs for
    every size 1..12 and the memory reserved within the load's plus the new graph pool
    (helexa plan's estimate) hold on a sound record; memory kept beyond that, a graph
    missing, or a 12-row batch decoding other tokens than the eager load each fail the
    stage by name, with the step where the tokens parted."""
    gc = _gpu_check()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_widen
    finally:
        sys.path.pop(0)
    path = gc.make_model(tmp_path, "dense", "qwen3", gc.sizes(True)["small"])
    w = gpu_widen.Widen({"sizes": gc.sizes(False), "device": "cuda", "dense": path},
                        lambda partial: None)
    rows, gib = list(range(1, 13)), 2**30
    tokens = [[7, 8, 9]] * 12

    def check(after: int, captured: list[int], eager: list[list[int]],
              pools_after: dict[str, int] | None = None, old: list[list[int]] | None = None,
              old_gap: float = 1.0) -> dict[str, Any]:
        state = dict(captured_logged=rows, rows_after=12, tokens_after=1024,
                     captured_after=captured, reserved_after=after,
                     graph_pools_after=pools_after or {"1:7": 8 * 2**20})
        w.out.update(captured_before=rows[:4], reserved_load=gib,
                     graph_pools_load={"1:3": 4 * 2**20},
                     widened=dict(state, answer="ok"),
                     failure=dict(state, answer="re-planning the pool failed: OutOfMemory"))
        w.tokens = {"old": old or tokens[:4], "wide": tokens, "eager": eager,
                    "after_failure": tokens}
        w.gaps = {"old": [[old_gap] * 3 for _ in range(4)]}
        checks = w.checks()
        return {"failed": [k for k, ok in checks.items() if not ok], "out": w.out}

    sound = check(gib + 64 * 2**20, rows, tokens)
    assert sound["failed"] == [], sound
    est = sound["out"]["graph_pool_estimate"]
    assert est["new"] > est["old"] > 0 and sound["out"]["reserved_growth"] == 64 * 2**20
    assert check(gib + est["new"] + 2**20, rows, tokens)["failed"] == [
        "reserved_within_load_plus_new_pool", "reserved_after_failure_within"]
    assert check(gib, rows[1:], tokens)["failed"] == ["graphs_at_new_rows",
                                                      "failure_kept_width"]
    wrong = check(gib, rows, [[7, 8, 9]] * 11 + [[7, 3, 9]])
    assert wrong["failed"] == ["wide_matches_eager"]
    assert wrong["out"]["first_divergence"]["wide_vs_eager"] == 1
    # the load's graph pool still held after the widen: its memory was not given back
    kept = check(gib + 64 * 2**20, rows, tokens, pools_after={"1:3": 4 * 2**20, "1:7": 1})
    assert kept["failed"] == ["old_graph_pools_released"], kept["failed"]
    # the first 4 rows part from the 4-row run: at a near tie (gap 0.0625) a batch of
    # another width may flip, and passes; at a clear choice (gap 1.0) it fails
    parted = [[7, 8, 9]] * 3 + [[7, 8, 4]]
    tie = check(gib, rows, tokens, old=parted, old_gap=0.0625)
    assert tie["failed"] == [] and tie["out"]["old_gap_at_divergence"] == 0.0625
    assert check(gib, rows, tokens, old=parted)["failed"] == ["wide_matches_old_rows"]


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")


def test_the_wheel_folder_fills_only_what_the_machine_lacks(tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    """Offline install plan: a requirement the machine meets stays; an unmet one takes the
    folder's wheel and follows that wheel's own requirements; torch is never taken; what
    has no wheel is named."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_wheels
    finally:
        sys.path.pop(0)
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "flashinfer_python", "0.6.13", ["apache-tvm-ffi<0.2,>=0.1.6", "torch",
                                                   "nvidia-cutlass-dsl>=4.5.0",
                                                   'cuda-python>=13.0; extra == "nvep"'])
    _wheel(folder, "apache_tvm_ffi", "0.1.15", [])
    _wheel(folder, "torch", "2.13.0", [])
    _wheel(folder, "msgspec", "0.23.0", [])
    have = {"msgspec": "0.23.0", "torch": "2.11.0", "structlog": "20.1.0"}
    monkeypatch.setattr(gpu_wheels, "installed",
                        lambda n: gpu_wheels.Version(have[n]) if n in have else None)
    monkeypatch.setattr(gpu_wheels, "wanted", lambda root: [gpu_wheels.Requirement(r) for r in (
        "torch==2.13.0", "msgspec>=0.18", "structlog>=24.1", "flashinfer-python==0.6.13")])
    install, met, missing = gpu_wheels.plan(ROOT, folder)
    assert sorted(p.name.split("-")[0] for p in install) == ["apache_tvm_ffi",
                                                             "flashinfer_python"]
    assert met == ["msgspec 0.23.0"]
    assert missing == ["structlog>=24.1 (installed: 20.1.0)",
                       "nvidia-cutlass-dsl>=4.5.0 (installed: none)"]
    # a later, stricter requirement of a name the machine met: the folder's wheel is taken
    _wheel(folder, "transformers", "4.57.0", ["tokenizers>=0.22"])
    _wheel(folder, "tokenizers", "0.22.1", [])
    have.update(tokenizers="0.20.3")
    monkeypatch.setattr(gpu_wheels, "wanted", lambda root: [gpu_wheels.Requirement(r) for r in (
        "tokenizers>=0.19", "transformers>=4.50")])
    install, met, missing = gpu_wheels.plan(ROOT, folder)
    assert sorted(p.name.split("-")[0] for p in install) == ["tokenizers", "transformers"]
    assert met == [] and missing == []
