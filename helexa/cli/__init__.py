"""The `helexa` command: one entry point, a subcommand per job.

Each subcommand lives in its own module, imported only when it runs (so
`helexa plan` never imports torch); the module's `main(argv) -> int` parses
its own arguments.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "neuron": ("helexa.neuron.daemon", "run the per-host neuron daemon (gRPC)"),
    "router": ("helexa.router.app", "run the OpenAI-compatible router (HTTP)"),
    "up": ("helexa.cli.up", "run a neuron and a router on loopback with a default model"),
    "plan": ("helexa.cli.plan", "print the KV-pool arithmetic of a neuron config"),
    "config": ("helexa.cli.config", "check, render or document config files"),
    "model": ("helexa.cli.model", "model utilities (init-tiny)"),
    "generate": ("helexa.neuron.generate", "generate text offline from a checkpoint folder"),
    "bench": ("helexa.loadgen.bench", "HTTP load against any OpenAI-compatible endpoint"),
    "ctl": ("helexa.neuron.ctl", "runtime operations on a running neuron"),
    "journal": ("helexa.cli.journal", "reports from the daemons' JSON logs"),
    "deploy": ("helexa.cli.deploy", "validate, render and ship configs to hosts"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: helexa COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`helexa COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from helexa import __version__
        print(f"helexa {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"helexa: unknown command `{name}`\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"helexa {name}: not implemented yet", file=sys.stderr)
            return 3
        raise
    return int(module.main(rest) or 0)

