"""The `helexa` entry point: lists its subcommands and says when one is not built yet."""

from __future__ import annotations

import subprocess
import sys

from helexa import cli

DESIGNED = ["neuron", "router", "up", "plan", "config", "model", "generate", "bench", "ctl",
            "journal", "deploy"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helexa.cli", *args], capture_output=True, text=True)


def test_lists_every_designed_subcommand():
    r = run("--help")
    assert r.returncode == 0
    for name in DESIGNED:
        assert f"\n  {name} " in r.stdout, name


def test_no_arguments_prints_usage_and_fails():
    r = run()
    assert r.returncode != 0 and "usage: helexa COMMAND" in r.stdout


def test_unknown_command_fails_naming_it():
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command `frobnicate`" in r.stderr


def test_unimplemented_command_says_so(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "later", ("helexa.not_written_yet", "a future command"))
    assert cli.main(["later"]) != 0
    assert "helexa later: not implemented yet" in capsys.readouterr().err


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("helexa ")
