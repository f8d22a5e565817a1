"""`helexa deploy ship` to a local folder target: what an operator sees and what lands.

The folder stands in for the hosts (DIR/HOST/etc/helexa/neuron.toml); the
systemctl calls a real ship would make are recorded in DIR/HOST/actions.log.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from helexa.cli.deploy import main

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "asset" / "models" / "helexa" / "tiny-qwen3" / "config.json"
NEURON_SECRET = "neuron-token-7f3a9c1e-never-print"
KEYS_SECRET = "sk-keys-file-b41d-never-print"

NEURON = """\
[server]
name = "gpu-1"
listen = "0.0.0.0:7070"
token_file = "{token}"

[admission]
max_in_flight = 16

[kv]
kv_budget_mb = 64
kv_dtype = "auto"

[[models]]
id = "helexa/tiny-qwen3"
path = "/srv/models/helexa/tiny-qwen3"
config = "../models/tiny-qwen3/config.json"
"""

ROUTER = """\
[auth]
keys_file = "{keys}"
require_auth = true

[neurons]
token_file = "{token}"

[[neurons.endpoints]]
name = "gpu-1"
address = "gpu-1.internal:7070"
"""


class Shipper:
    """An asset folder with one neuron host and a router, a target folder, and the outputs seen."""

    def __init__(self, tmp: Path, capsys) -> None:
        self.assets, self.hosts, self.capsys = tmp / "asset", tmp / "hosts", capsys
        (self.assets / "neuron").mkdir(parents=True)
        (self.assets / "models" / "tiny-qwen3").mkdir(parents=True)
        shutil.copy(TINY_CONFIG, self.assets / "models" / "tiny-qwen3" / "config.json")
        secrets = tmp / "secrets"
        secrets.mkdir()
        (secrets / "neuron.token").write_text(NEURON_SECRET + "\n")
        (secrets / "keys.toml").write_text(f'"{KEYS_SECRET}" = "alice"\n')
        self.neuron_file = self.assets / "neuron" / "gpu-1.toml"
        self.neuron_file.write_text(NEURON.format(token=secrets / "neuron.token"))
        (self.assets / "router.toml").write_text(
            ROUTER.format(keys=secrets / "keys.toml", token=secrets / "neuron.token"))
        self.outputs: list[str] = []

    def ship(self, *args: str) -> tuple[int, str, str]:
        rc = main(["ship", *args, "--assets", str(self.assets), "--target", f"local:{self.hosts}"])
        out, err = self.capsys.readouterr()
        self.outputs += [out, err]
        return rc, out, err

    def edit(self, old: str, new: str) -> None:
        text = self.neuron_file.read_text()
        assert old in text
        self.neuron_file.write_text(text.replace(old, new))

    def shipped(self, host: str = "gpu-1", name: str = "neuron.toml") -> dict:
        return tomllib.loads((self.hosts / host / "etc" / "helexa" / name).read_text())

    def actions(self, host: str = "gpu-1") -> list[str]:
        log = self.hosts / host / "actions.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def shipper(tmp_path: Path, capsys) -> Shipper:
    return Shipper(tmp_path, capsys)


def test_first_ship_copies_the_effective_config_and_restarts(shipper: Shipper) -> None:
    rc, out, _ = shipper.ship("gpu-1", "--router", "edge-1")
    assert rc == 0
    cfg = shipper.shipped()
    assert cfg["admission"]["max_in_flight"] == 16
    assert cfg["engine"]["max_slots"] == 8  # defaults are filled in
    assert cfg["models"] == [{"id": "helexa/tiny-qwen3", "path": "/srv/models/helexa/tiny-qwen3",
                              "tp": 1, "dtype": "auto", "quantize": "none",
                              "quant_group_size": 128, "preload": True, "priority": 0,
                              "tool_parser": "auto", "reasoning_parser": "auto",
                              "thinking_budget_tokens": 4096}]
    assert "models[0].config (../models/tiny-qwen3/config.json) not shipped" in out
    assert shipper.shipped("edge-1", "router.toml")["neurons"]["endpoints"][0]["name"] == "gpu-1"
    assert shipper.actions() == ["systemctl restart helexa-neuron"]
    assert shipper.actions("edge-1") == ["systemctl restart helexa-router"]
    assert "restart helexa-neuron (first ship: the host has no config)" in out


def test_second_ship_of_the_same_config_does_nothing(shipper: Shipper) -> None:
    shipper.ship("gpu-1")
    target = shipper.hosts / "gpu-1" / "etc" / "helexa" / "neuron.toml"
    before = target.stat().st_mtime_ns
    rc, out, _ = shipper.ship("gpu-1")
    assert rc == 0
    assert "unchanged: nothing copied, nothing to do" in out
    assert target.stat().st_mtime_ns == before
    assert shipper.actions() == ["systemctl restart helexa-neuron"]


def test_a_reload_safe_change_reloads(shipper: Shipper) -> None:
    shipper.ship("gpu-1")
    shipper.edit("max_in_flight = 16", "max_in_flight = 32")
    rc, out, _ = shipper.ship("gpu-1")
    assert rc == 0
    assert "  admission.max_in_flight: 16 -> 32 (reload)\n" in out
    assert "reload helexa-neuron (only reload-safe fields changed: admission.max_in_flight)" in out
    assert shipper.shipped()["admission"]["max_in_flight"] == 32
    assert shipper.actions() == ["systemctl restart helexa-neuron", "systemctl reload helexa-neuron"]


def test_a_load_time_change_restarts_and_names_the_field(shipper: Shipper) -> None:
    shipper.ship("gpu-1")
    shipper.edit('kv_dtype = "auto"', 'kv_dtype = "int8"')
    shipper.edit("max_in_flight = 16", "max_in_flight = 8")
    rc, out, _ = shipper.ship("gpu-1")
    assert rc == 0
    assert "  kv.kv_dtype: \"auto\" -> \"int8\" (restart)\n" in out
    assert "restart helexa-neuron (load-time fields changed: kv.kv_dtype)" in out
    assert shipper.actions()[-1] == "systemctl restart helexa-neuron"


def test_dry_run_shows_the_diff_and_copies_nothing(shipper: Shipper) -> None:
    shipper.ship("gpu-1")
    shipper.edit("max_in_flight = 16", "max_in_flight = 32")
    rc, out, _ = shipper.ship("gpu-1", "--dry-run")
    assert rc == 0
    assert "  -max_in_flight = 16\n" in out and "  +max_in_flight = 32\n" in out
    assert "would reload helexa-neuron" in out and "dry run: nothing copied" in out
    assert shipper.shipped()["admission"]["max_in_flight"] == 16
    assert shipper.actions() == ["systemctl restart helexa-neuron"]


@pytest.mark.parametrize("old,new,message", [
    ("max_in_flight = 16", "max_in_flght = 16", "admission.max_in_flght: unknown key"),
    ("max_in_flight = 16", 'max_in_flight = "many"', "admission.max_in_flight: expected `int`"),
    ('config = "../models', 'context = 999999\nconfig = "../models', "models[0].context: expected at most"),
    ("kv_budget_mb = 64", "", "models[0].kv_budget_mb: expected kv_budget_mb (the model's or kv.kv_budget_mb)"),
], ids=["unknown-key", "wrong-type", "context-cannot-fit", "cpu-without-a-budget"])
def test_an_invalid_config_is_refused_and_nothing_copied(shipper: Shipper, old, new, message) -> None:
    shipper.edit(old, new)
    rc, out, err = shipper.ship("gpu-1", "--router", "edge-1")
    assert rc == 2
    assert message.replace("`int`", "int") in err
    assert "refused, nothing copied" in err
    assert not shipper.hosts.exists()  # not even the valid router config went out


def test_a_router_alias_chain_is_refused_with_the_routers_words(shipper: Shipper) -> None:
    router = shipper.assets / "router.toml"
    router.write_text(router.read_text() + '\n[aliases]\nfast = "balanced"\nbalanced = "tiny"\n')
    rc, _, err = shipper.ship("gpu-1", "--router", "edge-1")
    assert rc == 2
    assert f"{router}: aliases.fast: points at another alias balanced; expected a model id" in err
    assert not shipper.hosts.exists()


def test_no_secret_in_any_output_or_shipped_file(shipper: Shipper) -> None:
    shipper.ship("gpu-1", "--router", "edge-1")
    shipper.edit("max_in_flight = 16", "max_in_flight = 32")
    shipper.ship("gpu-1", "--router", "edge-1", "--dry-run")
    shipper.ship("gpu-1", "--router", "edge-1")
    # a rotated secret is not a config change: the file is never read
    token = Path(shipper.shipped()["server"]["token_file"])
    token.write_text("rotated-" + NEURON_SECRET)
    rc, out, _ = shipper.ship("gpu-1")
    assert rc == 0 and "unchanged" in out
    shipped = [p.read_text() for p in shipper.hosts.rglob("*") if p.is_file()]
    assert shipper.outputs and shipped
    for text in shipper.outputs + shipped:
        assert NEURON_SECRET not in text and KEYS_SECRET not in text
    assert str(token) in shipper.shipped()["server"]["token_file"]  # the path is shipped


def test_unknown_host_is_refused(shipper: Shipper) -> None:
    rc, _, err = shipper.ship("gpu-9")
    assert rc == 2
    assert "gpu-9: no " in err and "refused, nothing copied" in err
    assert not shipper.hosts.exists()


def test_a_drain_longer_than_the_unit_stop_timeout_is_refused(shipper: Shipper) -> None:
    # helexa-neuron.service: TimeoutStopSec=90 covers drain_secs + 30 s, so 60 is the most
    shipper.edit('name = "gpu-1"', 'name = "gpu-1"\ndrain_secs = 75')
    rc, _, err = shipper.ship("gpu-1")
    assert rc == 2
    assert "server.drain_secs: expected at most 60 (TimeoutStopSec=90 of helexa-neuron.service" in err
    assert not shipper.hosts.exists()


def _fake_bin(folder: Path, log: Path) -> None:
    """`ssh`, `rsync`, `sudo` and `systemctl` stand-ins that act locally and log their calls."""
    folder.mkdir()
    scripts = {
        # ssh -o BatchMode=yes HOST COMMAND
        "ssh": f'echo "ssh $3 $4" >> {log}\nexec sh -c "$4"\n',
        # rsync [--rsync-path P] --checksum --chmod=F644 SRC HOST:DEST
        "rsync": f'echo "rsync $*" >> {log}\nfor a; do last=$a; done\n'
                 'src=""; for a; do case $a in /*) src=$a;; esac; done\n'
                 'mkdir -p "$(dirname "${last#*:}")" && cp "$src" "${last#*:}"\n',
        "sudo": 'exec "$@"\n',
        "systemctl": f'echo "systemctl $*" >> {log}\n',
    }
    for name, body in scripts.items():
        p = folder / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(0o755)


def test_ssh_target_reads_copies_and_reloads_over_ssh(shipper: Shipper, tmp_path: Path,
                                                       monkeypatch) -> None:
    log, remote = tmp_path / "calls.log", tmp_path / "remote" / "etc" / "helexa"
    _fake_bin(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")

    def ship(*extra: str) -> tuple[int, str]:
        rc = main(["ship", "gpu-1", "--assets", str(shipper.assets), "--target", "ssh",
                   "--remote-dir", str(remote), "--sudo", *extra])
        return rc, shipper.capsys.readouterr().out

    rc, out = ship()
    assert rc == 0 and "first ship" in out
    assert tomllib.loads((remote / "neuron.toml").read_text())["admission"]["max_in_flight"] == 16
    shipper.edit("max_in_flight = 16", "max_in_flight = 24")
    rc, out = ship()
    assert rc == 0 and "reload helexa-neuron" in out
    calls = log.read_text().splitlines()
    assert [c for c in calls if c.startswith("systemctl")] == [
        "systemctl restart helexa-neuron", "systemctl reload helexa-neuron"]
    assert "ssh gpu-1 sudo systemctl reload helexa-neuron" in calls
    assert any(c.startswith("rsync --rsync-path sudo rsync --checksum") and
               c.endswith(f"gpu-1:{remote}/neuron.toml") for c in calls)
