"""`helexa config check FILE…`, `config render FILE`, `config doc`."""

from __future__ import annotations

import argparse
import sys

import tomli_w

from helexa.config.schema import SCHEMAS, ConfigError, detect_kind, load_config, to_plain


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="helexa config", description=__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="validate config files (kind from the file name unless --kind)")
    check.add_argument("files", nargs="+")
    check.add_argument("--kind", choices=sorted(SCHEMAS))
    render = sub.add_parser("render", help="print the effective config (defaults filled in) as TOML")
    render.add_argument("file")
    render.add_argument("--kind", choices=sorted(SCHEMAS))
    doc = sub.add_parser("doc", help="write the config reference generated from the schema")
    doc.add_argument("--output", "-o", default="-", help="file to write; - = stdout")
    args = ap.parse_args(argv)

    if args.action == "doc":
        from helexa.config.doc import render_reference
        text = render_reference()
        if args.output == "-":
            sys.stdout.write(text)
        else:
            with open(args.output, "w") as f:
                f.write(text)
        return 0

    files = args.files if args.action == "check" else [args.file]
    status = 0
    for path in files:
        kind = args.kind or detect_kind(path)
        try:
            cfg = load_config(path, SCHEMAS[kind])
            if kind == "neuron":
                from helexa.plan import check_neuron_config
                check_neuron_config(path, cfg)
        except ConfigError as e:
            print(e, file=sys.stderr)
            status = 2
            continue
        if args.action == "check":
            print(f"{path}: ok ({kind})")
        else:
            sys.stdout.write(tomli_w.dumps(to_plain(cfg)))
    return status
