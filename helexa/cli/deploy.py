"""`helexa deploy ship HOST…`: validate, render and ship configs, then reload or restart.

1. Validate every `asset/neuron/<host>.toml` (schema + the `helexa plan`
   arithmetic: a `context` the pool cannot hold is refused) and
   `asset/router.toml`. Any error refuses the whole ship: nothing is copied.
2. Render each host's effective config (defaults filled) with tomli-w.
3. Compare it, key by key, with what the host has.
4. Copy it (rsync over ssh; or a local folder, for tests and dry runs).
5. Reload the daemon (`systemctl reload` → SIGHUP) when only reload-safe
   fields changed, restart it when a load-time field changed (or on the first
   ship), and say which fields decided.

Secrets are never read: `token_file` and `keys_file` are paths in the config
and their files are provisioned on the hosts by other means; their contents
are never rendered, diffed or printed.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import tomli_w

from helexa.cli.deploy_targets import LocalTarget, SshTarget, Target
from helexa.config.diff import Change, changes
from helexa.config.schema import (
    RESTART,
    ConfigError,
    NeuronConfig,
    RouterConfig,
    load_config,
    to_plain,
)

UNITS = {"neuron": "helexa-neuron", "router": "helexa-router"}
UNIT_DIR = Path(__file__).resolve().parents[2] / "deploy"  # the repo's systemd units
DRAIN_MARGIN_SECS = 30.0  # after the drain, engines need this long to exit before SIGKILL
SCHEMAS: dict[str, type[msgspec.Struct]] = {"neuron": NeuronConfig, "router": RouterConfig}


@dataclass
class Shipment:
    """One config for one host: validated, rendered, ready to compare and copy."""

    host: str
    kind: str  # neuron | router
    source: Path
    text: str
    notes: list[str]

    @property
    def unit(self) -> str:
        return UNITS[self.kind]

    @property
    def file_name(self) -> str:
        return f"{self.kind}.toml"


# ------------------------------------------------------------------ validating


def stop_timeout_secs(unit_file: Path) -> float | None:
    """TimeoutStopSec of a systemd unit in seconds (plain seconds, `Ns` or `Nmin`)."""
    if not unit_file.exists():
        return None
    for line in unit_file.read_text().splitlines():
        if line.startswith("TimeoutStopSec="):
            value = line.split("=", 1)[1].strip()
            if value.endswith("min"):
                return float(value[:-3]) * 60
            return float(value.removesuffix("s"))
    return None


def validate(assets: Path, unit_dir: Path = UNIT_DIR) -> tuple[dict[str, Any], list[str]]:
    """Load and plan every config under `assets`; returns (configs by file, errors)."""
    from helexa.plan import check_neuron_config  # the same arithmetic as `helexa plan`

    loaded: dict[str, Any] = {}
    errors: list[str] = []
    stop_secs = stop_timeout_secs(unit_dir / f"{UNITS['neuron']}.service")
    for path in sorted((assets / "neuron").glob("*.toml")):
        try:
            cfg = load_config(path, NeuronConfig)
            check_neuron_config(path, cfg)
        except ConfigError as e:
            errors.append(str(e))
            continue
        drain = cfg.server.drain_secs
        if stop_secs is not None and drain + DRAIN_MARGIN_SECS > stop_secs:
            errors.append(f"{path}: server.drain_secs: expected at most {stop_secs - DRAIN_MARGIN_SECS:g}"
                          f" (TimeoutStopSec={stop_secs:g} of {UNITS['neuron']}.service less"
                          f" {DRAIN_MARGIN_SECS:g} s for the engines to exit), got {drain:g}")
            continue
        loaded[str(path)] = cfg
    router = assets / "router.toml"
    if router.exists():
        try:
            loaded[str(router)] = load_config(router, RouterConfig)
        except ConfigError as e:
            errors.append(str(e))
    return loaded, errors


def render(source: Path, cfg: msgspec.Struct) -> tuple[str, list[str]]:
    """The effective config as the host will read it, and notes about what was left out."""
    plain = to_plain(cfg)
    notes: list[str] = []
    for i, model in enumerate(plain.get("models", []) if isinstance(cfg, NeuronConfig) else []):
        # `config` is the planning copy of config.json in the repo; on the host the
        # weights are at an absolute `path`, whose config.json the daemon plans from.
        if "config" in model and "path" in model and Path(model["path"]).is_absolute() \
                and not Path(model["config"]).is_absolute():
            notes.append(f"models[{i}].config ({model.pop('config')}) not shipped:"
                         f" the host plans from {model['path']}/config.json")
        elif "path" in model and not Path(model["path"]).is_absolute():
            notes.append(f"warning: models[{i}].path `{model['path']}` is relative:"
                         " on the host it is read from the config file's folder")
    head = f"# Rendered by `helexa deploy ship` from {source.name}; edit that file, not this one.\n"
    return head + tomli_w.dumps(plain), notes


# ------------------------------------------------------------------ comparing


def compare(kind: str, current: str, rendered: str) -> list[Change]:
    """Fields that differ between the host's config and the rendered one."""
    try:
        old = tomllib.loads(current)
    except tomllib.TOMLDecodeError:
        return [Change("(unreadable file on the host)", None, None, RESTART)]
    return changes(SCHEMAS[kind], old, tomllib.loads(rendered))


def decide(current: str | None, changes: list[Change]) -> tuple[str | None, str]:
    """(systemctl verb or None, why) for a shipment."""
    if current is None:
        return "restart", "first ship: the host has no config"
    if not changes:
        return None, "unchanged"
    load_time = [c.key for c in changes if c.apply == RESTART]
    if load_time:
        return "restart", "load-time fields changed: " + ", ".join(load_time)
    return "reload", "only reload-safe fields changed: " + ", ".join(c.key for c in changes)


def _show(v: Any) -> str:
    return "(unset)" if v is None else tomli_w.dumps({"v": v}).split(" = ", 1)[1].strip().replace("\n", " ")


# ------------------------------------------------------------------ shipping


def ship_one(s: Shipment, target: Target, dry_run: bool, say) -> None:
    current = target.read(s.host, s.file_name)
    changes = compare(s.kind, current, s.text) if current is not None else []
    verb, why = decide(current, changes)
    say(f"{s.host}: {s.kind} config {target.describe(s.host, s.file_name)} ({s.source})")
    for note in s.notes:
        say(f"  {note}")
    for c in changes:
        say(f"  {c.key}: {_show(c.before)} -> {_show(c.after)} ({c.apply})")
    if verb is None:
        say("  unchanged: nothing copied, nothing to do")
        return
    if dry_run:
        before = (current or "").splitlines(True)
        diff = difflib.unified_diff(before, s.text.splitlines(True),
                                    f"{s.host}:{s.file_name}", f"rendered {s.source.name}")
        say("".join("  " + line for line in diff).rstrip("\n"))
        say(f"  would {verb} {s.unit} ({why}); dry run: nothing copied")
        return
    target.write(s.host, s.file_name, s.text)
    target.systemctl(s.host, verb, s.unit)
    say(f"  copied; {verb} {s.unit} ({why})")


def plan_shipments(hosts: list[str], routers: list[str], assets: Path,
                   loaded: dict[str, Any]) -> tuple[list[Shipment], list[str]]:
    ships: list[Shipment] = []
    errors: list[str] = []
    for host in hosts:
        path = assets / "neuron" / f"{host}.toml"
        if str(path) not in loaded:
            if not path.exists():  # an invalid file has already said why
                errors.append(f"{host}: no {path} (a neuron host needs its config)")
            continue
        text, notes = render(path, loaded[str(path)])
        if loaded[str(path)].server.name != host:  # routers and logs will call it by that name
            notes.append(f"warning: server.name is `{loaded[str(path)].server.name}`, not `{host}`")
        ships.append(Shipment(host, "neuron", path, text, notes))
    router = assets / "router.toml"
    for host in routers:
        if str(router) not in loaded:
            if not router.exists():
                errors.append(f"{host}: no {router} to ship")
            continue
        text, notes = render(router, loaded[str(router)])
        ships.append(Shipment(host, "router", router, text, notes))
    return ships, errors


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="helexa deploy", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    ship = sub.add_parser("ship", help="validate, render and ship configs; reload or restart")
    ship.add_argument("hosts", nargs="*", metavar="HOST",
                      help="neuron hosts: ships asset/neuron/HOST.toml to each")
    ship.add_argument("--router", action="append", default=[], metavar="HOST",
                      help="ship asset/router.toml to this host (repeatable)")
    ship.add_argument("--assets", default="asset", help="the asset folder (default asset)")
    ship.add_argument("--target", default="ssh",
                      help="ssh (rsync + systemctl over ssh) or local:DIR (DIR/HOST/etc/helexa/…)")
    ship.add_argument("--units", default=str(UNIT_DIR),
                      help="folder of the systemd units (their TimeoutStopSec bounds drain_secs)")
    ship.add_argument("--remote-dir", default="/etc/helexa", help="config folder on the hosts")
    ship.add_argument("--sudo", action="store_true", help="run systemctl and writes with sudo (ssh)")
    ship.add_argument("--dry-run", action="store_true", help="show the diff and the action; copy nothing")
    args = ap.parse_args(argv)
    if not args.hosts and not args.router:
        ap.error("name at least one HOST or --router HOST")

    assets = Path(args.assets)
    loaded, errors = validate(assets, Path(args.units))
    ships, missing = plan_shipments(args.hosts, args.router, assets, loaded)
    if errors or missing:
        for e in errors + missing:
            print(e, file=sys.stderr)
        print("helexa deploy: refused, nothing copied", file=sys.stderr)
        return 2
    if args.target.startswith("local:"):
        target: Target = LocalTarget(Path(args.target.removeprefix("local:")), args.remote_dir)
    elif args.target == "ssh":
        target = SshTarget(args.remote_dir, sudo=args.sudo)
    else:
        ap.error(f"--target: expected ssh or local:DIR, got {args.target}")
    status = 0
    for s in ships:
        try:
            ship_one(s, target, args.dry_run, print)
        except (OSError, RuntimeError) as e:
            print(f"{s.host}: {s.kind}: ship failed: {e}", file=sys.stderr)
            status = 1
    return status
