"""Where `helexa deploy ship` writes configs and runs systemctl: a local folder standing in
for the hosts (tests, rehearsals), or the hosts themselves over ssh and rsync."""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Protocol


class Target(Protocol):
    """Where configs go: read what a host has, write a file, run systemctl."""

    def describe(self, host: str, name: str) -> str: ...
    def read(self, host: str, name: str) -> str | None: ...
    def write(self, host: str, name: str, text: str) -> None: ...
    def systemctl(self, host: str, verb: str, unit: str) -> None: ...


class LocalTarget:
    """A folder standing in for the hosts: ROOT/HOST/etc/helexa/…; systemctl is recorded
    in ROOT/HOST/actions.log instead of run (for tests and rehearsals)."""

    def __init__(self, root: Path, remote_dir: str) -> None:
        self.root, self.remote_dir = root, remote_dir.strip("/")

    def _path(self, host: str, name: str) -> Path:
        return self.root / host / self.remote_dir / name

    def describe(self, host: str, name: str) -> str:
        return str(self._path(host, name))

    def read(self, host: str, name: str) -> str | None:
        p = self._path(host, name)
        return p.read_text() if p.exists() else None

    def write(self, host: str, name: str, text: str) -> None:
        p = self._path(host, name)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(p)  # atomic, as rsync's rename is

    def systemctl(self, host: str, verb: str, unit: str) -> None:
        with (self.root / host / "actions.log").open("a") as f:
            f.write(f"systemctl {verb} {unit}\n")


class SshTarget:
    """Real hosts: `ssh HOST cat`, `rsync` over ssh, `ssh HOST systemctl`."""

    def __init__(self, remote_dir: str, sudo: bool = False) -> None:
        self.remote_dir, self.sudo = remote_dir.rstrip("/"), sudo

    def describe(self, host: str, name: str) -> str:
        return f"{host}:{self.remote_dir}/{name}"

    def _ssh(self, host: str, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ssh", "-o", "BatchMode=yes", host, command],
                              capture_output=True, text=True, timeout=60)

    def read(self, host: str, name: str) -> str | None:
        path = shlex.quote(f"{self.remote_dir}/{name}")
        done = self._ssh(host, f"if [ -e {path} ]; then cat {path}; else exit 3; fi")
        if done.returncode == 3:
            return None
        if done.returncode != 0:
            raise RuntimeError(f"ssh {host}: {done.stderr.strip() or done.returncode}")
        return done.stdout

    def write(self, host: str, name: str, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(text)
            f.flush()
            cmd = ["rsync", "--checksum", "--chmod=F644", f.name, f"{host}:{self.remote_dir}/{name}"]
            if self.sudo:
                cmd[1:1] = ["--rsync-path", "sudo rsync"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"rsync to {host}: {done.stderr.strip()}")

    def systemctl(self, host: str, verb: str, unit: str) -> None:
        done = self._ssh(host, f"{'sudo ' if self.sudo else ''}systemctl {verb} {unit}")
        if done.returncode != 0:
            raise RuntimeError(f"ssh {host} systemctl {verb} {unit}: {done.stderr.strip()}")
