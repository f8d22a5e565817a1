"""The docs cannot drift from the code: the config reference is regenerated and
compared, every key it lists agrees with `field_apply`, and every example config
validates (and plans) as the daemons would load it."""

from __future__ import annotations

import ast
import difflib
import functools
import re
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from helexa.config import schema as config
from helexa.config.doc import UndocumentedField, render_reference
from helexa.config.schema import (
    RELOAD,
    AdmissionConfig,
    ConfigError,
    NeuronConfig,
    detect_kind,
    field_apply,
    field_meta,
    load_config,
)

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "config.md"
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.toml"))


def stale_diff(committed: str, rendered: str) -> str:
    """Empty when docs/config.md is what the schema renders, else the diff to apply."""
    return "".join(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                        "docs/config.md (committed)", "rendered from helexa/config/schema.py"))


def test_config_reference_is_current() -> None:
    diff = stale_diff(REFERENCE.read_text(), render_reference())
    assert not diff, "docs/config.md is stale; run `helexa config doc -o docs/config.md`\n" + diff


class _AdmissionPlus(AdmissionConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_tokens_per_minute: Annotated[int, field_meta("Token rate cap per principal.", RELOAD, ge=1)] = 100


class _NeuronPlus(NeuronConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    admission: _AdmissionPlus = msgspec.field(default_factory=_AdmissionPlus)


def test_a_field_added_without_regenerating_is_caught(monkeypatch) -> None:
    monkeypatch.setitem(config.SCHEMAS, "neuron", _NeuronPlus)
    diff = stale_diff(REFERENCE.read_text(), render_reference())
    added = [line for line in diff.splitlines() if line.startswith("+|")]
    assert added == ["+| `admission.max_tokens_per_minute` | integer ≥ 1 | `100` | reload"
                     " | Token rate cap per principal. |"]


class _Undocumented(NeuronConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    secret_knob: int = 0


def test_a_field_without_doc_and_apply_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(config.SCHEMAS, "neuron", _Undocumented)
    with pytest.raises(UndocumentedField, match="`secret_knob`"):
        render_reference()


def _reference_rows() -> list[tuple[str, str, str]]:
    """(kind, dotted key, apply) of every row of docs/config.md."""
    rows, kind = [], ""
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("## "):
            kind = {"Neuron": "neuron", "Router": "router"}.get(line[3:].split(":")[0], "models")
        m = re.match(r"^\| `([^`]+)` \| .* \| (reload|restart) \| .* \|$", line)
        if m:
            rows.append((kind, m.group(1), m.group(2)))
    return rows


def test_reference_agrees_with_field_apply() -> None:
    # deploy decides reload vs restart with field_apply: the doc must say the same
    rows = _reference_rows()
    assert len(rows) > 50
    for kind, key, apply in rows:
        schema_path = key.replace("[]", "").replace(".<name>", "")
        assert field_apply(config.SCHEMAS[kind], schema_path) == apply, key
    keys = {key for _, key, _ in rows}
    assert {"admission.max_in_flight", "models[].tp", "profiles.<name>.kv_dtype",
            "neurons.endpoints[].address", "aliases"} <= keys


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load_and_plan(path: Path) -> None:
    kind = detect_kind(path)
    cfg = load_config(path, config.SCHEMAS[kind])
    if kind == "neuron":
        from helexa.plan import check_neuron_config
        plans = check_neuron_config(path, cfg)
        assert [p.model_id for p in plans] == [m.id for m in cfg.models]


def test_examples_cover_both_daemons() -> None:
    kinds = {detect_kind(p) for p in EXAMPLES}
    assert kinds == {"neuron", "router"}


def test_a_broken_example_would_be_caught(tmp_path: Path) -> None:
    bad = tmp_path / "neuron.toml"
    bad.write_text((ROOT / "docs/examples/neuron-cpu.toml").read_text()
                   .replace("max_slots = 4", "max_slot = 4"))
    with pytest.raises(ConfigError, match="engine.max_slot: unknown key"):
        load_config(bad, NeuronConfig)


# ------------------------------------------------------------- prose vs code

# every doc but the generated reference (whose catalogue keys are a third schema's)
PROSE = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "config.md"] + [
    ROOT / "README.md"]
_TOP_KEYS = {f.name for schema in (config.NeuronConfig, config.RouterConfig)
             for f in msgspec.structs.fields(schema)}


def test_sample_output_in_operating_md_is_what_the_command_prints(monkeypatch, capsys) -> None:
    from helexa.cli.plan import main as plan_main

    text = (ROOT / "docs" / "operating.md").read_text()
    m = re.search(r"<!-- output of: helexa plan (\S+) -->\n```\n(.*?)```", text, re.S)
    assert m, "operating.md lost its `helexa plan` sample"
    monkeypatch.chdir(ROOT)
    assert plan_main([m.group(1)]) == 0
    assert capsys.readouterr().out == m.group(2), (
        f"docs/operating.md: the `helexa plan {m.group(1)}` sample is stale; paste the new output")


def test_config_keys_named_in_the_docs_exist() -> None:
    named, events = set(), _logged_events()  # `engine.step_failed` is an event, not a key
    for doc in PROSE:
        for key in re.findall(r"`([a-z_]+(?:\[\])?(?:\.(?:<name>|[a-z_]+)(?:\[\])?)+)`", doc.read_text()):
            if key.split(".")[0].removesuffix("[]") in _TOP_KEYS and key not in events:
                named.add((str(doc.relative_to(ROOT)), key))
    assert len(named) > 20
    for doc, key in sorted(named):
        path = key.replace("[]", "").replace(".<name>", "")
        found = []
        for schema in (config.NeuronConfig, config.RouterConfig):
            try:
                field_apply(schema, path)
                found.append(schema)
            except KeyError:
                pass
        assert found, f"{doc} names `{key}`, which no config schema has"


def _source_metric_patterns() -> list[re.Pattern[str]]:
    patterns = []
    for folder in ("neuron", "router"):
        for py in (ROOT / "helexa" / folder).rglob("*.py"):
            for lit in re.findall(r"\"(helexa_[a-z_{}]+)\"", py.read_text()):
                patterns.append(re.compile(re.sub(r"\\\{[a-z_]*\\\}", "[a-z_]+", re.escape(lit)) + "$"))
    return patterns


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([a-z_,]+)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def test_metric_names_in_the_docs_exist_in_the_code() -> None:
    patterns = _source_metric_patterns()
    names = {n for doc in PROSE
             for raw in re.findall(r"`(helexa_[a-z_{},]+)`", doc.read_text()) for n in _expand(raw)}
    assert len(names) > 20
    for name in sorted(names):
        base = name.removesuffix("_total")  # prometheus_client adds _total to counters
        assert any(p.match(name) or p.match(base) for p in patterns), \
            f"the docs name metric `{name}`, which neither helexa/neuron/ nor helexa/router/ defines"


def test_commands_named_in_the_docs_exist() -> None:
    from helexa.cli import COMMANDS

    for doc in PROSE:
        for cmd in re.findall(r"(?<![\w/.-])helexa ([a-z]+)\b", doc.read_text()):
            if cmd not in {"serves"}:  # prose, not a command
                assert cmd in COMMANDS, f"{doc.relative_to(ROOT)} names `helexa {cmd}`"


# ------------------------------------------------------------- the contracts vs code

CONTRACTS = {name: ROOT / "docs" / f"{name}.md" for name in ("http", "grpc", "errors",
                                                               "observability")}
_SOURCES = [p for p in sorted((ROOT / "helexa").rglob("*.py")) if "proto" not in p.parts]
_LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


@functools.cache
def _tree(py: Path) -> ast.Module:
    """A source file's syntax tree, parsed once for all the tests that walk the sources."""
    return ast.parse(py.read_text())


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _code_literals(tree: ast.AST) -> set[str]:
    """Error codes a module can give: `code="…"` arguments, the first argument of
    Refusal/Problem, and {status: code} / (status, code) tables."""
    codes: set[str] = set()
    types = {id(a.value) for a in ast.walk(tree) if isinstance(a, ast.Assign)
             and any(getattr(t, "id", "") in ("_TYPES", "_ERROR_TYPES")  # `type`, not codes
                     for t in a.targets)}
    for node in ast.walk(tree):
        if id(node) in types:
            continue
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "code" and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, str):
                    codes.add(kw.value.value)
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name in ("Refusal", "Problem") and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                codes.add(node.args[0].value)
        pairs: list[tuple[ast.AST | None, ast.AST]] = []
        if isinstance(node, ast.Dict):
            pairs = list(zip(node.keys, node.values, strict=True))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
            pairs = [(node.elts[0], node.elts[1])]
        for key, value in pairs:
            if isinstance(key, ast.Constant) and isinstance(key.value, int) \
                    and 400 <= key.value < 600 and isinstance(value, ast.Constant) \
                    and isinstance(value.value, str):
                codes.add(value.value)
    return codes


def _emitted_codes() -> set[str]:
    from helexa.neuron.grpc_status import STATUS_OF_CODE
    from helexa.router.rpc_errors import CODE_STATUS

    codes = set(STATUS_OF_CODE) | set(CODE_STATUS)
    for py in _SOURCES:
        if py.parts[-2] in ("router", "neuron", "engine"):
            codes |= _code_literals(_tree(py))
    return codes


def _error_table() -> dict[str, str]:
    """code → its rows in docs/errors.md's table (the first name in the `code` column); the
    Anthropic table after it gives types, which test_the_anthropic_error_table_… checks."""
    rows: dict[str, str] = {}
    for line in CONTRACTS["errors"].read_text().split("On `/v1/messages`")[0].splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 5 and not line.startswith("| situation"):
            code = re.match(r"`([a-z_]+)`", cells[2])
            if code:
                rows[code.group(1)] = rows.get(code.group(1), "") + line + "\n"
    return rows


def test_every_error_code_the_code_gives_is_in_the_error_table() -> None:
    emitted, table = _emitted_codes(), _error_table()
    assert {"overloaded", "context_length_exceeded", "request_too_large", "timeout",
            "not_found", "model_busy"} <= emitted  # the scan sees every kind of source
    assert not emitted - set(table), f"docs/errors.md lacks {sorted(emitted - set(table))}"
    assert not set(table) - emitted, \
        f"docs/errors.md lists codes nothing gives: {sorted(set(table) - emitted)}"


def test_the_error_table_states_the_status_each_code_gets() -> None:
    from helexa.neuron.grpc_status import STATUS_OF_CODE
    from helexa.router.rpc_errors import CODE_STATUS

    table = _error_table()
    for code, status in CODE_STATUS.items():
        assert f"| {status} |" in table[code], f"docs/errors.md: `{code}` is HTTP {status}"
    for code, grpc_status in STATUS_OF_CODE.items():
        assert f"`{grpc_status.name}`" in table[code], \
            f"docs/errors.md: the neuron gives `{code}` as {grpc_status.name}"


def test_every_route_is_in_the_http_doc() -> None:
    from helexa.config.schema import RouterConfig
    from helexa.router.app import RouterState, build_app

    app = build_app(RouterState(RouterConfig(), None))
    served = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    documented = set(re.findall(r"^\| `([A-Z]+)` \| `(/[^`]*)` \|", CONTRACTS["http"].read_text(),
                                re.M))
    assert len(served) >= 6
    assert not served - documented, f"docs/http.md lacks routes {sorted(served - documented)}"
    assert not documented - served, f"docs/http.md lists routes not served: {documented - served}"


def test_every_rpc_is_in_the_grpc_doc() -> None:
    from helexa.proto import neuron_pb2 as pb

    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["Neuron"].methods}
    documented = set(re.findall(r"^\| `([A-Za-z]+)` \| (?:unary|server stream) \|",
                                CONTRACTS["grpc"].read_text(), re.M))
    assert {"Generate", "Watch"} <= rpcs
    assert rpcs == documented, f"docs/grpc.md: missing {rpcs - documented}, extra {documented - rpcs}"


def _registered_metrics() -> set[str]:
    """Every metric family the daemons register, as Prometheus exposes it."""
    from types import SimpleNamespace

    from helexa.neuron.metrics import NeuronMetrics
    from helexa.router.metrics import RouterMetrics

    names = set()
    for registry in (NeuronMetrics(SimpleNamespace(models={})).registry,  # type: ignore[arg-type]
                     RouterMetrics(lambda: []).registry):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_every_registered_metric_is_in_the_observability_doc() -> None:
    registered = _registered_metrics()
    documented = {n for raw in re.findall(r"`((?:helexa_|vllm:)[a-z_{},]+)`",
                                          CONTRACTS["observability"].read_text())
                  for n in _expand(raw)}
    assert len(registered) > 25
    assert not registered - documented, \
        f"docs/observability.md lacks metrics {sorted(registered - documented)}"
    assert not documented - registered, \
        f"docs/observability.md lists metrics nobody registers: {sorted(documented - registered)}"


def _logged_events() -> set[str]:
    events = set()
    for py in _SOURCES:
        for node in ast.walk(_tree(py)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _LOG_METHODS and node.args:
                events |= {s for s in _strings(node.args[0])
                           if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+", s)}
            # a kernel's verdicts (helexa/kernels/cuda/__init__.py) log its event's pair
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Verdicts":
                event = node.args[0].value  # type: ignore[attr-defined]
                events |= {f"{event}_chosen", f"{event}_fallback"}
    return events


def test_every_logged_event_is_in_the_observability_doc() -> None:
    logged = _logged_events()
    text = CONTRACTS["observability"].read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    documented = {e for row in table.splitlines()
                  for e in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)`", row.split(" | ")[0])}
    assert {"request.start", "request.done", "request.rejected", "neuron.down"} <= logged
    assert not logged - documented, f"docs/observability.md lacks events {sorted(logged - documented)}"
    assert not documented - logged, \
        f"docs/observability.md lists events nothing logs: {sorted(documented - logged)}"


def test_the_repository_cites_only_its_own_docs() -> None:
    # The design lives in docs/; nothing may point at a document outside the repository.
    tracked = [p for folder in ("helexa", "proto", "tests",
                                "bench", "docs", "deploy")
               for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in
               (".py", ".md", ".proto", ".toml", ".sh", ".c")]
    tracked += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    stale = [str(p.relative_to(ROOT)) for p in tracked
             if p != Path(__file__) and re.search(r"\bDESIGN(\.md|'s)\b", p.read_text(errors="replace"))]
    assert not stale, f"these cite a DESIGN document that is not in the repository: {stale}"
    for link in re.findall(r"\]\(([a-z_]+\.md)(?:#[a-z-]+)?\)",
                           "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))):
        assert (ROOT / "docs" / link).exists(), f"docs link to a missing docs/{link}"



def _sections(doc: Path) -> set[str]:
    """A doc's headings and its bold paragraph leads (`**Ports to open.**`): what a
    citation may name."""
    text = doc.read_text()
    return ({h.strip() for h in re.findall(r"^#+\s+(.*)$", text, re.M)}
            | {b.rstrip(".:") for b in re.findall(r"^\*\*([^*]+)\*\*", text, re.M)})


# a section cited after a comma, after a space, or in brackets: the forms the repository writes
_CITATION = re.compile(r'docs/(\w+\.md),? \(?"([^"]+)"')


def _citing_files() -> list[Path]:
    return [*ROOT.glob("helexa/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("bench/*.sh"),
            *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md"), *ROOT.glob("asset/**/*.toml"),
            *ROOT.glob("deploy/*"), ROOT / "README.md", ROOT / "Makefile"]


def test_every_docs_section_the_repository_cites_exists() -> None:
    # Code and docs cite a section as `docs/architecture.md, "The KV pool and its ledger"`;
    # a heading renamed or removed leaves the citation pointing at nothing.
    sections = {d.name: _sections(d) for d in (ROOT / "docs").glob("*.md")}
    cited, missing = 0, []
    for f in _citing_files():
        flat = re.sub(r"\n\s*(?:#\s*)?", " ", f.read_text())  # a citation broken over lines
        for doc, section in _CITATION.findall(flat):
            cited += 1
            if doc not in sections:
                missing.append(f"{f.relative_to(ROOT)}: docs/{doc} does not exist")
            elif not any(h.startswith(section) for h in sections[doc]):
                missing.append(f"{f.relative_to(ROOT)}: docs/{doc} has no section {section!r}")
    assert cited > 10  # the scan sees the citations
    assert not missing, "\n".join(missing)


def test_a_citation_without_quotes_or_a_comma_is_still_read() -> None:
    # the three forms the repository writes, each read as (doc, section)
    for text in ('(docs/operating.md, "The GPU check")', 'as docs/operating.md "The GPU check" says',
                 'in docs/operating.md ("The GPU check").'):
        assert _CITATION.findall(text) == [("operating.md", "The GPU check")], text


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # a `# comment` is no heading
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        a = _anchor(heading)
        anchors.add(f"{a}-{seen[a]}" if a in seen else a)  # GitHub numbers a repeated one
        seen[a] = seen.get(a, 0) + 1
    return anchors


def test_every_link_into_a_doc_names_a_heading_it_has() -> None:
    # `[api.md](api.md#images)`, `[…](#generation-requests)`: a heading renamed leaves the
    # link opening the page at its top
    links, missing = 0, []
    for doc in _ALL_DOCS:
        for target, anchor in re.findall(r"\]\(((?:docs/)?\w+\.md)?#([^)\s]+)\)", doc.read_text()):
            path = doc if not target else (doc.parent / target)
            links += 1
            if not path.exists():
                missing.append(f"{doc.name}: {target} does not exist")
            elif anchor not in _anchors(path):
                missing.append(f"{doc.name}: {path.name} has no heading #{anchor}")
    assert links > 30 and _anchor("`POST /v1/responses` (OpenAI Responses)") == \
        "post-v1responses-openai-responses"
    assert not missing, "\n".join(missing)


def test_every_status_the_prose_gives_a_code_is_the_tables() -> None:
    # "a 503 `overloaded`", "404 `model_not_found`" anywhere in the docs: the status the
    # error table (and the router) gives that code
    from helexa.router.rpc_errors import CODE_STATUS

    table = {code: {int(s) for s in re.findall(r"\| ([1-5]\d\d) \|", rows)}
             for code, rows in _error_table().items()}
    pairs = [(doc.name, int(status), code) for doc in _ALL_DOCS for status, code in
             re.findall(r"\b([1-5]\d\d) `([a-z_]+)`", " ".join(doc.read_text().split()))]
    assert len(pairs) > 20 and table["overloaded"] == {CODE_STATUS["overloaded"]}
    wrong = [f"docs/{doc}: {status} `{code}`, which is {sorted(table[code])}"
             for doc, status, code in pairs if code in table and status not in table[code]]
    # and the neuron's gRPC status beside a code: "`INTERNAL` `upstream_error`",
    # "`INVALID_ARGUMENT invalid_request_error`"
    from helexa.neuron.grpc_status import STATUS_OF_CODE

    grpc_pairs = [(doc.name, status, code) for doc in _ALL_DOCS for status, code in
                  re.findall(r"`([A-Z][A-Z_]{3,})(?:` `| )([a-z_]+)`", " ".join(doc.read_text().split()))
                  if code in STATUS_OF_CODE]
    assert len(grpc_pairs) >= 3
    wrong += [f"docs/{doc}: {status} `{code}`, which the neuron gives as {STATUS_OF_CODE[code].name}"
              for doc, status, code in grpc_pairs if STATUS_OF_CODE[code].name != status]
    assert not wrong, "\n".join(wrong)

# `helexa/…` source paths in prose: a file (.py, .c) or a folder (trailing slash), not an
# alias such as helexa/balanced, a config file name, or proto/helexa/… (checked as part of it).
_SOURCE_PATH = re.compile(r"(?<![\w/.-])(helexa/(?:\w+/)*(?:\w+\.(?:py|c))?)(?![\w/.-])")


def _named_source_paths() -> dict[str, set[str]]:
    """path → the docs that name it, over docs/*.md and README.md."""
    named: dict[str, set[str]] = {}
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for path in _SOURCE_PATH.findall(doc.read_text()):
            named.setdefault(path, set()).add(doc.name)
    return named


def test_every_source_path_the_docs_name_exists() -> None:
    named = _named_source_paths()
    assert {"helexa/budget.py", "helexa/neuron/engine/"} <= set(named)  # the scan sees both
    missing = {p: sorted(docs) for p, docs in named.items() if not (ROOT / p).exists()}
    assert not missing, f"the docs name files that are not in the tree: {missing}"


def test_the_code_map_names_every_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    code_map = text[text.index("## Code map"):]
    code_map = code_map[:code_map.index("\n## ")] if "\n## " in code_map else code_map
    listed = set(re.findall(r"^\| `(helexa/(?:\w+/)*)` \|", code_map, re.M))
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "helexa").rglob("__init__.py")}
    assert "helexa/neuron/engine/" in packages
    assert not packages - listed, f"docs/architecture.md's code map lacks {sorted(packages - listed)}"
    assert not listed - packages, f"the code map lists what is no package: {sorted(listed - packages)}"


def test_no_doc_or_config_holds_a_merge_conflicts_markers() -> None:
    """A merge's unresolved conflict left in prose or a shipped config (ruff catches them in
    code): every doc, example and asset file reads as one text."""
    files = [*ROOT.glob("docs/**/*.md"), *ROOT.glob("docs/**/*.toml"), ROOT / "README.md",
             *ROOT.glob("asset/**/*.toml")]
    marked = [f"{f.relative_to(ROOT)}:{n}" for f in files
              for n, line in enumerate(f.read_text().splitlines(), 1)
              if re.match(r"(<{7}|>{7}|={7})( |$)", line)]
    assert len(files) > 10 and marked == []


def _status_cells(table: str) -> list[tuple[set[int], str]]:
    """(HTTP statuses, the row's first backticked name) of each row of a markdown table."""
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 3 and (name := re.match(r"`([a-z_]+)`", cells[2])):
            rows.append(({int(s) for s in re.findall(r"\b[1-5]\d\d\b", cells[1])}, name.group(1)))
    return rows


def test_the_anthropic_error_table_is_what_the_router_sends() -> None:
    from helexa.router import anthropic_errors

    text = CONTRACTS["errors"].read_text()
    openai_part, anthropic_part = text.split("On `/v1/messages`", 1)
    given = set().union(*(s for s, _ in _status_cells(openai_part)))
    rows = _status_cells(anthropic_part)
    assert {400, 401, 404, 413, 429, 502, 503, 504} <= given  # the scan sees the table
    covered: set[int] = set()
    for statuses, doc_type in rows:
        for status in statuses:
            sent = anthropic_errors._ERROR_TYPES.get(status, "api_error")
            assert sent == doc_type, f"docs/errors.md: /v1/messages answers {status} as `{sent}`"
        covered |= statuses
    assert not given - covered, \
        f"docs/errors.md: the Anthropic table lacks statuses {sorted(given - covered)}"
    assert not covered - given, \
        f"docs/errors.md: the Anthropic table has statuses nothing gives: {sorted(covered - given)}"


def test_every_log_component_is_named_in_the_observability_doc() -> None:
    components = set()
    for py in _SOURCES:
        text = py.read_text()
        components |= set(re.findall(r"get_logger\((?:component=)?\"([a-z_]+)\"", text))
    text = CONTRACTS["observability"].read_text()
    sentence = text[text.index("Every line has `event`, `component`"):]
    sentence = sentence[:sentence.index("`level`")]
    named = set(re.findall(r"`([a-z_]+)`", sentence)) - {"event", "component"}
    assert {"router", "neuron"} <= components  # the scan sees both daemons
    assert components == named, \
        f"docs/observability.md names components {sorted(named)}; the code logs {sorted(components)}"


# ------------------------------------------------------------- commands the docs show

_ALL_DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _fenced_blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """((language, body) of each fenced block, the prose around them) of a markdown text."""
    blocks: list[tuple[str, str]] = []
    prose: list[str] = []
    fence: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        m = re.match(r"\s*```(\w*)", line)
        if m and fence is None:
            fence = (m.group(1), [])
        elif m:
            blocks.append((fence[0], "\n".join(fence[1])))
            fence = None
        elif fence is not None:
            fence[1].append(line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def _shown_commands(text: str) -> list[tuple[str, bool]]:
    """(`helexa …` command line, whether it is a whole one from a shell block) in a doc.
    Inline spans are prose: `FILE…` is FILE, `[--flag]` the flag, and a span offering
    alternatives (`a|b`, `[FILE|-]`) is one command per alternative, and one with a
    placeholder in angle brackets or braces is left out."""
    found: list[tuple[str, bool]] = []
    blocks, prose = _fenced_blocks(text)
    for lang, block in blocks:
        if lang not in ("", "sh", "bash"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#\s.*$", "", line)
            for segment in re.split(r"&&|\|\||\||;", line):
                if re.match(r"\s*(?:\S*/)?helexa\s", segment):
                    found.append((segment.strip(), True))
    spans = []
    for span in re.findall(r"`((?:\.venv/bin/)?helexa [^`]+)`", prose.replace("\n", " ")):
        # `helexa ctl status|load` is one command per alternative; `[FILE|-]` either
        m = re.search(r"\[?([\w-]+(?:\\?\|[\w-]+)+)\]?", span)
        spans += [span[:m.start()] + alt + span[m.end():]
                  for alt in re.split(r"\\?\|", m.group(1))] if m else [span]
    for span in spans:
        if re.search(r"[<{]", span):
            continue
        span = re.sub(r"\[([^\]]*)\]", r"\1", span.replace("…", " "))
        found.append((span, False))
    return found


class _Parsed(Exception):
    pass


def _parse_error(monkeypatch, command: str) -> str | None:
    """None when `helexa` parses the command line, else argparse's complaint."""
    import argparse
    import shlex

    from helexa.cli import main as helexa_main

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    def error(self, message):
        raise SystemExit(f"{self.prog}: {message}")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(argparse.ArgumentParser, "error", error)
    argv = shlex.split(command)[1:]
    try:
        code = helexa_main(argv)
    except _Parsed:
        return None
    except SystemExit as e:
        return str(e.code)
    return None if code == 0 else f"exit status {code} before its arguments were parsed"


def test_every_command_the_docs_show_parses(monkeypatch) -> None:
    shown = [(doc.relative_to(ROOT), cmd, whole) for doc in _ALL_DOCS
             for cmd, whole in _shown_commands(doc.read_text())]
    assert len([s for s in shown if s[2]]) > 10 and len(shown) > 30  # the scan sees both kinds
    wrong = []
    for doc, cmd, whole in shown:
        why = _parse_error(monkeypatch, cmd)
        # prose may name a command without its required arguments (`helexa plan`), or
        # with a placeholder for a value the parser checks (`--url URL`)
        if why is not None and not whole and ("arguments are required" in why or any(
                re.fullmatch(r"[A-Z][A-Z_.]*", word) and f"`{word}`" in why
                for word in cmd.split())):
            why = None
        if why is not None:
            wrong.append(f"{doc}: `{cmd}`: {why}")
    assert not wrong, "\n".join(wrong)


class _Any:
    """A stand-in engine report or Watch status: every figure 1, so every series shows."""

    drafter = "ngram"
    model = "m"
    state = 2
    models: list[_Any] = []

    def __getattr__(self, name: str) -> object:
        return _Any() if name in ("kv", "engine_status", "status") else 1

    def __int__(self) -> int:
        return 1


def _metric_types_and_labels() -> dict[str, tuple[str, set[str]]]:
    """exposed name → (type, label names) of every metric family the daemons register, each
    series shown once (the collectors' from a model that reports everything)."""
    from types import SimpleNamespace

    from helexa.neuron.metrics import NeuronMetrics
    from helexa.router.metrics import RouterMetrics

    model = SimpleNamespace(model_id="m", state=2, engine_status=_Any())
    status = _Any()
    status.models = [_Any()]
    link = SimpleNamespace(name="n", healthy=lambda *_: True, status=status)
    out: dict[str, tuple[str, set[str]]] = {}
    for registry in (NeuronMetrics(SimpleNamespace(models={"m": model})).registry,  # type: ignore[arg-type]
                     RouterMetrics(lambda: [link]).registry):  # type: ignore[list-item]
        for collector in list(registry._collector_to_names):  # noqa: SLF001
            for family in collector.collect():
                labels = getattr(collector, "_labelnames", None)
                if labels is None:
                    labels = {k for s in family.samples for k in s.labels} - {"le"}
                    assert family.samples, f"{family.name}: the stand-in shows no series"
                name = family.name + ("_total" if family.type == "counter" else "")
                out[name] = (family.type, set(labels))
    return out


def test_the_observability_doc_states_each_metrics_type_and_labels() -> None:
    registered = _metric_types_and_labels()
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in CONTRACTS["observability"].read_text().splitlines()
            if re.match(r"\| `(?:helexa_|vllm:)", line)]
    assert len(rows) > 30
    for cells in rows:
        doc_type, doc_labels = cells[1], {x.strip() for x in cells[2].split(",") if x.strip()}
        for raw in re.findall(r"`((?:helexa_|vllm:)[a-z_{},]+)`", cells[0]):
            for name in _expand(raw):
                kind, labels = registered[name]
                assert kind == doc_type, f"docs/observability.md: `{name}` is a {kind}"
                assert labels == doc_labels, \
                    f"docs/observability.md: `{name}` is labelled {sorted(labels)}"


def test_every_environment_variable_the_docs_name_is_read() -> None:
    def names(paths) -> set[str]:
        return {n for p in paths for n in re.findall(r"\bHELEXA_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}

    named = names(_ALL_DOCS)
    read = names([*(ROOT / "helexa").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
                  *(ROOT / "bench").glob("*.sh"), ROOT / "Makefile"])
    assert {"HELEXA_CACHE", "HELEXA_LOOKAHEAD"} <= named  # the scan sees the docs
    assert not named - read, f"the docs name variables nothing reads: {sorted(named - read)}"


def test_the_helexa_up_banner_in_operating_md_is_what_up_prints() -> None:
    from helexa.cli import up

    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    m = re.search(r"`HELEXA UP (\S+) model (\S+) \(aliases: ([^)]*)\)`", text)
    assert m, "operating.md lost its `HELEXA UP …` sample"
    assert m.group(2) == up.TINY_MODEL_ID, f"helexa up serves the tiny model as {up.TINY_MODEL_ID}"
    assert m.group(3).split(", ") == list(up.ALIASES)
    assert "HELEXA UP {url}/v1  model {model_id} (aliases: " in (ROOT / "helexa/cli/up.py").read_text()


_UNITS = {"": 1, "s": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def _defaults_stated(text: str) -> list[tuple[str, float]]:
    """(key, value) where prose gives a key's default in brackets: `limits.max_tools` tools
    (128), `limits.max_schema_bytes` (512 KiB), `timeouts.client_write_secs` (30 s)."""
    return [(key, float(num.replace(",", "")) * _UNITS[unit])
            for key, num, unit in re.findall(
                r"`([a-z_]+\.[a-z_]+)`[^`()]{0,12}\((\d[\d,.]*) ?(KiB|MiB|GiB|s)?\)", text)]


def test_defaults_the_prose_states_are_the_schemas() -> None:
    stated = [(doc.name, key, value) for doc in PROSE for key, value in
              _defaults_stated(doc.read_text())]
    assert {"limits.max_tools", "timeouts.client_write_secs"} <= {k for _, k, _ in stated}
    for doc, key, value in stated:
        defaults = []
        for cfg in (config.NeuronConfig(), config.RouterConfig()):
            section, name = key.split(".")
            if hasattr(getattr(cfg, section, None), name):
                defaults.append(getattr(getattr(cfg, section), name))
        assert value in defaults, f"docs/{doc}: `{key}` defaults to {defaults}, not {value:g}"


def test_limits_the_docs_state_are_the_codes_constants() -> None:
    import inspect

    from helexa.neuron import status
    from helexa.router import errors, event_replies, request_model
    from helexa.router.json_depth import MAX_JSON_DEPTH

    docs = {name: " ".join((ROOT / "docs" / f"{name}.md").read_text().split())
            for name in ("http", "errors", "api", "grpc", "architecture")}
    watch_hz = round(1 / inspect.signature(status.StatusHub).parameters["min_interval_secs"].default)
    stated = [
        ("http", f"JSON nested at most {MAX_JSON_DEPTH} levels"),
        ("errors", f"JSON nested deeper than {MAX_JSON_DEPTH} levels"),
        ("http", f"`stop` (up to {request_model.MAX_STOP} strings, each up to "
                 f"{request_model.MAX_STOP_CHARS:,} characters), `stop_token_ids` (up to "
                 f"{request_model.MAX_STOP_TOKEN_IDS:,})"),
        ("api", f"`stop` takes at most {request_model.MAX_STOP} strings of at most "
                f"{request_model.MAX_STOP_CHARS:,} characters each, and `stop_token_ids` at "
                f"most {request_model.MAX_STOP_TOKEN_IDS:,} ids"),
        ("http", f"`n` (1–{request_model.MAX_N})"),
        ("http", f"at most {request_model.MAX_MODEL_CHARS} characters;"),
        ("api", f"alias, at most {request_model.MAX_MODEL_CHARS} characters"),
        ("errors", f"`model` itself is at most {request_model.MAX_MODEL_CHARS} characters"),
        ("errors", f"a type or range error, longer than {errors.MAX_ECHO_CHARS} characters"),
        ("errors", f"message longer than {errors.MAX_MESSAGE_CHARS:,} characters"),
        ("http", f"`top_logprobs` (0–{request_model.MAX_TOP_LOGPROBS_CHAT})"),
        ("http", f"`logprobs` (0–{request_model.MAX_LOGPROBS_COMPLETION})"),
        ("api", f"`logprobs` (0..{request_model.MAX_LOGPROBS_COMPLETION})"),
        ("api", f"a `ping` event goes out every {event_replies.PING_SECS:g} s"),
        ("api", f"(`: ping`) goes out every {event_replies.PING_SECS:g} s"),
        ("grpc", f"(at most {watch_hz} a second)"),
        ("architecture", f"(at most {watch_hz} messages a second)"),
    ]
    missing = [f"docs/{doc}.md: {text!r}" for doc, text in stated if text not in docs[doc]]
    assert not missing, "the docs no longer state the code's limit:\n" + "\n".join(missing)


def _members() -> dict[str, set[str]]:
    """class → the names its body defines (methods, fields, self.x), over helexa/ and the
    proto's messages."""
    members: dict[str, set[str]] = {}
    for py in _SOURCES:
        for node in ast.walk(_tree(py)):
            if isinstance(node, ast.ClassDef):
                names = members.setdefault(node.name, set())
                for n in ast.walk(node):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(n.name)
                    elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                        names.add(n.target.id)
                    elif isinstance(n, ast.Assign):
                        names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        names.add(n.attr)
    proto = (ROOT / "proto/helexa/neuron/v1/neuron.proto").read_text()
    for name, body in re.findall(r"^message (\w+) \{(.*?)^\}", proto, re.S | re.M):
        members.setdefault(name, set()).update(re.findall(r"(\w+) = \d+;", body))
    return members


# llama.cpp's converter, which quantization.md names as the source of a GGUF's tensors
_FOREIGN_CLASSES = {"Qwen3NextModel", "Qwen2MoeModel"}


def test_every_class_member_the_docs_name_exists() -> None:
    members = _members()
    named = {(doc.name, cls, attr) for doc in _ALL_DOCS for cls, attr in re.findall(
        r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z_0-9]*)(?:\([^)]*\))?`", doc.read_text())}
    assert {("architecture.md", "Sampler", "choose"), ("grpc.md", "Image", "data")} <= named
    missing = [f"{doc}: `{cls}.{attr}`" for doc, cls, attr in sorted(named)
               if cls not in _FOREIGN_CLASSES and attr not in members.get(cls, set())]
    assert not missing, f"the docs name members no class has: {missing}"


def test_every_name_the_docs_place_in_a_source_file_is_there() -> None:
    # "`helexa/budget.py` `host_tier_size`", "(helexa/kernels/cuda/quant_decode.py `prefill`"
    placed = {(doc.name, path, name) for doc in _ALL_DOCS for path, name in re.findall(
        r"`?(helexa/[\w/]+\.py)`?,? (?:its )?`([A-Za-z_]\w*)(?:\([^`]*\))?`",
        " ".join(doc.read_text().split()))}
    assert ("architecture.md", "helexa/budget.py", "host_tier_size") in placed
    missing = [f"{doc}: {path} `{name}`" for doc, path, name in sorted(placed)
               if not re.search(rf"^\s*(?:async def|def|class) {name}\b|^{name}\s*[:=]",
                                (ROOT / path).read_text(), re.M)]
    assert not missing, f"the docs place names where they are not defined: {missing}"


# the host operating.md walks through adding: named as the file you would write
_EXAMPLE_PATHS = {"asset/neuron/gpu-1.toml"}


def test_every_repository_path_the_docs_name_exists() -> None:
    # helexa/… is test_every_source_path_the_docs_name_exists'; these are the other folders
    named = {(doc.name, m.group(1)) for doc in _ALL_DOCS for m in re.finditer(
        r"(?<![\w/.-])((?:tests|bench|deploy|asset|proto|docs|\.github|\.ci)/[\w./-]*\w)",
        doc.read_text())}
    assert {"bench/gpu_check.sh", "proto/helexa/neuron/v1/neuron.proto"} <= {p for _, p in named}
    missing = sorted(f"{doc}: {path}" for doc, path in named
                     if path not in _EXAMPLE_PATHS and not (ROOT / path).exists())
    assert not missing, f"the docs name paths that are not in the tree: {missing}"


def test_the_tuning_table_names_only_reloadable_keys() -> None:
    # operating.md: "All of these apply on reload (SIGHUP), without touching weights or the pool"
    text = (ROOT / "docs" / "operating.md").read_text()
    table = text[text.index("## Tuning admission and profiles"):]
    table = "\n".join(line for line in table[:table.index("\n\n", table.index("| symptom"))]
                      .splitlines() if line.startswith("|"))
    keys = re.findall(r"`([a-z_]+\.[a-z_]+)`", table)
    assert len(keys) > 8
    restart = [k for k in keys if field_apply(NeuronConfig, k) != "reload"]
    # a restart key may be named only to say that it needs one
    restart = [k for k in restart if f"`{k}` itself needs a restart" not in table]
    assert not restart, f"docs/operating.md's reload table names restart keys {restart}"


def test_operating_md_lists_every_field_a_profile_overrides() -> None:
    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    sentence = text[text.index("is a named set of overrides of"):]
    sentence = sentence[:sentence.index(". ")]
    listed = {k.split(".")[1] for k in re.findall(r"`([a-z_]+\.[a-z_]+)`", sentence)}
    profile_fields = {f.name for f in msgspec.structs.fields(config.ProfileConfig)}
    assert listed == profile_fields, \
        f"docs/operating.md: a profile overrides {sorted(profile_fields)}, it lists {sorted(listed)}"


def _bounds(struct: type, name: str) -> tuple[float, float]:
    """The (lower, upper) bound msgspec checks on an optional numeric field."""
    import typing

    hint = typing.get_type_hints(struct, include_extras=True)[name]
    annotated = next(a for a in typing.get_args(hint) if typing.get_origin(a) is Annotated)
    meta = next(m for m in annotated.__metadata__ if isinstance(m, msgspec.Meta))
    lower = meta.ge if meta.ge is not None else meta.gt
    assert lower is not None and meta.le is not None, name
    return lower, meta.le


def test_the_sampling_ranges_in_http_md_are_the_request_models() -> None:
    from helexa.router.request_model import RequestBody

    def num(x: float) -> str:
        return f"{x:g}".replace("-", "−")

    def span(name: str) -> str:
        lower, upper = _bounds(RequestBody, name)
        return f"{num(lower)}–{num(upper)}"

    text = (ROOT / "docs" / "http.md").read_text()
    stated = [f"`temperature` ({span('temperature')})", f"`min_p` ({span('min_p')})",
              f"`top_p` ({num(_bounds(RequestBody, 'top_p')[0])} ≤ p ≤ "
              f"{num(_bounds(RequestBody, 'top_p')[1])})",
              f"`frequency_penalty` ({span('frequency_penalty')})",
              f"`repetition_penalty` ({span('repetition_penalty')})"]
    assert _bounds(RequestBody, "presence_penalty") == _bounds(RequestBody, "frequency_penalty")
    missing = [s for s in stated if s not in text]
    assert not missing, f"docs/http.md no longer states the ranges the router checks: {missing}"


def test_readme_lists_init_tinys_architectures() -> None:
    from helexa.cli import model

    source = (ROOT / "helexa/cli/model.py").read_text()
    assert "choices=ARCHS" in source and "choices=list(CHAT_TEMPLATES)" in source
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `helexa model init-tiny"))
    archs = re.search(r"\(([a-z0-9_, ]+);", row)
    assert archs, "README.md's init-tiny row lost its list of architectures"
    assert archs.group(1).split(", ") == list(model.ARCHS)
    for template in re.findall(r"--chat-template (\w+)", row):
        assert template in model.CHAT_TEMPLATES


def test_the_event_table_says_which_daemon_logs_each_event() -> None:
    """helexa/router/ logs the router's lines; the neuron's, its engines' and kernels' lines
    reach the neuron's journal."""
    sides: dict[str, set[str]] = {}
    for py in _SOURCES:
        side = "router" if "router" in py.relative_to(ROOT).parts else "neuron"
        for node in ast.walk(_tree(py)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _LOG_METHODS and node.args:
                for s in _strings(node.args[0]):
                    if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+", s):
                        sides.setdefault(s, set()).add(side)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Verdicts":
                for suffix in ("_chosen", "_fallback"):
                    sides.setdefault(node.args[0].value + suffix, set()).add(side)  # type: ignore[attr-defined]
    wrong = []
    for line in CONTRACTS["observability"].read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            said = {c.strip() for c in cells[1].split(",")}
            for event in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)`", cells[0]):
                if sides.get(event, said) != said:
                    wrong.append(f"`{event}`: {sorted(sides[event])}")
    assert len(sides) > 60
    assert not wrong, f"docs/observability.md's component column is wrong for {wrong}"


def test_the_h200_table_in_operating_md_is_the_runs_on_record() -> None:
    """docs/operating.md, "What one H200 gave": every figure of the table is the one in
    bench/results/gpu_check-h200-run{1,2}.json, rounded as printed."""
    import json

    runs = [json.loads((ROOT / f"bench/results/gpu_check-h200-run{i}.json").read_text())
            for i in (1, 2)]
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text[text.index("### What one H200 gave"):text.index("## Configs and shipping them")]

    def cell(label: str, run: int) -> list[float]:
        row = next(line for line in section.splitlines() if line.startswith(f"| {label} "))
        return [float(n.replace(",", "")) for n in
                re.findall(r"(?<![\w.-])-?\d[\d,]*(?:\.\d+)?", row.split(" | ")[run + 1])]

    def rate(r: dict, model: str, batch: str) -> list[float]:
        d = r["stages"]["decode"][model][batch]
        return [round(d["tok_s"]), round(d["roofline_fraction"], 2)]

    for i, r in enumerate(runs):
        st = r["stages"]
        diverge = [st["parity"][m]["first_divergence"] for m in ("dense", "hybrid")]
        expect = {
            "whole check (s)": [round(r["secs"])],
            "first load, FlashInfer's JIT included (s)": [round(st["compile"]["first_load_s"], 1)],
            "parity, dense, 32 greedy tokens": [diverge[0]] if diverge[0] else [32],
            "dense batch 8: tok/s, fraction": rate(r, "dense_big", "batch8"),
            "hybrid batch 8: tok/s, fraction": rate(r, "hybrid_big", "batch8"),
            "kernels a decode step, dense / hybrid":
                [st["profile"][m]["kernels_per_step"] for m in ("dense_big", "hybrid_big")],
            "host syncs a step, dense / hybrid":
                [st["profile"][m]["host_syncs_per_step"] for m in ("dense_big", "hybrid_big")],
            "TTFT, 4,096-token prompt, dense (ms)": [round(st["ttft"]["ttft_s"] * 1000, 1)],
        }
        for model, label in (("dense_big", "dense batch 1"), ("hybrid_big", "hybrid batch 1")):
            expect[f"{label}: tok/s, fraction of roofline" if model == "dense_big"
                   else f"{label}: tok/s, fraction"] = rate(r, model, "batch1") + (
                rate(r, model, "batch1_torch_norms") if "batch1_torch_norms"
                in st["decode"][model] else [])
        for label, figures in expect.items():
            assert cell(label, i)[:len(figures)] == figures, \
                f"docs/operating.md, run {i + 1}, {label!r}: the JSON says {figures}"
        assert cell("parity, hybrid", i)[0] == diverge[1]
    bandwidth = [f"{r['stages']['decode']['copy_bandwidth_gbs'] / 1000:.2f}" for r in runs]
    assert f"was {bandwidth[0]} and {bandwidth[1]} TB/s" in " ".join(section.split())
    # the prose under it reads run 2's profile: the kernels' device time a step, the five
    # matmul kernels' (cuBLAS's nvjet) share of the dense one's, and the hybrid's roofline
    prof, flat = runs[1]["stages"]["profile"], " ".join(section.split())
    matmuls = sum(k["us_per_step"] for k in prof["dense_big"]["top_kernels"]
                  if k["name"].startswith("nvjet"))
    roofline = 1e6 / runs[1]["stages"]["decode"]["hybrid_big"]["roofline_steps_per_s"]
    for said in (f"kernels take {prof['dense_big']['kernel_us_per_step']:,.0f} µs of device time, "
                 f"{matmuls:.0f} of it the five matmuls",
                 f"kernels take {prof['hybrid_big']['kernel_us_per_step']:,.0f} µs against an "
                 f"{roofline:.0f} µs roofline",
                 f"wall time is {1e6 / runs[1]['stages']['decode']['dense_big']['batch1']['tok_s']:,.0f}"
                 f" µs (the decode stage's"):
        assert said in flat, f"docs/operating.md no longer says {said!r}"


def test_operating_md_lists_every_status_json_field() -> None:
    # helexa/router/status.py: "The data's fields are listed in docs/operating.md"
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge

    from helexa.router.status import StatusBoard, neuron_view

    reg = CollectorRegistry()
    board = StatusBoard(SimpleNamespace(links={}),  # type: ignore[arg-type]
                        Counter("r", "", ["neuron", "model", "code"], registry=reg),
                        Counter("a", "", ["model", "code"], registry=reg), Gauge("g", "", registry=reg))
    snap = board.snapshot()
    link = SimpleNamespace(name="n", endpoint=SimpleNamespace(address="a", tls=False), status=None,
                           connected=False, last_seen=0.0, healthy=lambda now: False)
    fields = {"router": set(snap["router"]), "neurons[]": set(neuron_view(link, 0.0)),  # type: ignore[arg-type]
              "refusals": set(snap["refusals"]),
              "refusals.neuron": set(snap["refusals"]["neuron"])}
    assert set(snap) == {"router", "neurons", "refusals"}
    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    sentence = text[text.index("`/status.json` fields:"):]
    sentence = sentence[:sentence.index(").", sentence.index("`refusals`")) + 2]
    named = set(re.findall(r"`([a-z_]+)(?:\[\])?`", sentence))
    missing = {part: sorted(keys - named) for part, keys in fields.items() if keys - named}
    assert not missing, f"docs/operating.md's `/status.json` fields lack {missing}"


def test_the_tuning_tables_work_pool_refusals_name_the_keys_they_say() -> None:
    # operating.md: "429 naming `server.work_per_principal` …, or 503 naming
    # `server.work_threads`": each of the neuron's work-pool refusals, at the status the
    # router gives its code, names the key the row says
    from helexa.config.neuron import ServerConfig
    from helexa.neuron.work import NeuronWork
    from helexa.router.rpc_errors import CODE_STATUS
    from helexa.work_pool import OVER_SHARE

    pool = NeuronWork(ServerConfig(work_threads=2))
    said = {CODE_STATUS[r.code]: str(r) for r in (pool.refusal(OVER_SHARE, "alice"),
                                                  pool.refusal("pool_full", "alice"))}
    text = (ROOT / "docs" / "operating.md").read_text()
    table = text[text.index("## Tuning admission and profiles"):]
    claims = [(int(status), key) for status, key in
              re.findall(r"\b([1-5]\d\d) naming `(server\.work_[a-z_]+)`", table)]
    assert len(claims) == 2
    wrong = [f"{status} naming `{key}`: the {status} says {said.get(status)!r}"
             for status, key in claims if key not in said.get(status, "")]
    assert not wrong, f"docs/operating.md's tuning table: {wrong}"


def test_every_endpoint_a_doc_names_is_served_with_that_method() -> None:
    # `POST /v1/messages/count_tokens`, api.md's endpoint table, `GET /status.json` in
    # prose: the router serves that method on that path (HEAD and OPTIONS are answered on
    # every GET route and by CORS; `HEAD /` is named as the 404 it gets)
    from helexa.config.schema import RouterConfig
    from helexa.router.app import RouterState, build_app

    app = build_app(RouterState(RouterConfig(), None))
    served = {(r.method, re.sub(r"\{model:[^}]*\}", "{model}", r.resource.canonical))
              for r in app.router.routes() if r.resource is not None}
    named = {(doc.name, method, path) for doc in _ALL_DOCS for method, path in
             re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^` ]*)`?", doc.read_text())}
    assert ("api.md", "POST", "/v1/messages/count_tokens") in named and len(named) > 15
    wrong = sorted(f"docs/{doc}: {method} {path}" for doc, method, path in named
                   if (method, path) not in served)
    assert not wrong, f"the docs name endpoints the router does not serve so: {wrong}"


def test_the_speculation_tables_defaults_are_the_engines() -> None:
    # speculation.md's key table: "`spec_k` | … (default 4)", "`speculation` | … or `off`
    # (default)": the [engine] section's defaults, which a model and a profile override
    text = (ROOT / "docs" / "speculation.md").read_text()
    engine = config.NeuronConfig().engine
    stated = {}
    for key, meaning in re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", text, re.M):
        if m := re.search(r"\(default (\S+)\)", meaning):
            stated[key] = m.group(1)
        elif m := re.search(r"`([^`]+)` \(default\)", meaning):
            stated[key] = m.group(1)
    assert set(stated) == {"speculation", "spec_k"}
    wrong = {k: getattr(engine, k) for k, v in stated.items() if str(getattr(engine, k)) != v}
    assert not wrong, f"docs/speculation.md: the engine's defaults are {wrong}"


def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"`docs/(\w+\.md)`", readme[readme.index("## Documents"):
                                                         readme.index("## Tests and benchmarks")]))
    docs = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert not docs - listed, f"README.md's Documents lacks {sorted(docs - listed)}"


def test_metrics_are_named_in_the_prose_as_prometheus_exposes_them() -> None:
    # a counter's series is `…_total`: a dashboard query for the bare family name finds
    # nothing, so no doc may name one without it
    registered = _registered_metrics()
    named = {(doc.name, n) for doc in PROSE
             for raw in re.findall(r"`((?:helexa_|vllm:)[a-z_{},]+)`", doc.read_text())
             for n in _expand(raw)}
    assert ("speculation.md", "helexa_spec_acceptance_rate") in named
    wrong = sorted(f"docs/{doc}: `{n}`" + (" (its series is `_total`)" if f"{n}_total" in registered
                                          else "") for doc, n in named if n not in registered)
    assert not wrong, f"the docs name metrics the daemons do not expose: {wrong}"


def test_what_the_docs_say_ctl_is_told_is_what_it_prints(monkeypatch, capsys) -> None:
    # `helexa ctl` speaks gRPC: a refusal reaches it as the status and `helexa-code` it
    # prints ("helexa ctl: UNAVAILABLE shutting_down: …"), never as an HTTP status
    import grpc

    from helexa.neuron import ctl
    from helexa.neuron.grpc_status import STATUS_OF_CODE

    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    told = re.findall(r"`ctl (\w+)` (?:is told|fails) `?([A-Z_]+|\d{3})`? ?`?([a-z_]+)`", text)
    assert len(told) >= 3
    for op, status, code in told:
        async def refused(args, status=STATUS_OF_CODE[code], code=code):
            raise grpc.aio.AioRpcError(status, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(("helexa-code", code)), "why")
        monkeypatch.setattr(ctl, "_run", refused)
        assert ctl.main([op, "m"] + (["p"] if op == "profile" else [])) == 1
        printed = capsys.readouterr().err
        assert printed.startswith(f"helexa ctl: {status} {code}: "), \
            f"docs/operating.md: `ctl {op}` is told {status} {code}, but ctl prints {printed!r}"


def test_more_figures_the_docs_state_are_the_codes_constants() -> None:
    # as test_limits_the_docs_state_are_the_codes_constants, for the figures it leaves out:
    # backoffs, Retry-After, CORS, stream pausing, the router's estimate and edges, the
    # measured pool's margin, the prefill bound
    from helexa.neuron import resident_model
    from helexa.neuron.engine import flow, memory_plan
    from helexa.router import client_stream, cors, dispatch, http_edge, inflight, selection

    docs = {name: " ".join((ROOT / "docs" / f"{name}.md").read_text().split())
            for name in ("http", "errors", "grpc", "operating", "architecture")}
    backoff = (f"backoff ({resident_model.FAILED_RETRY_SECS:g} s, doubling per failure, at most "
               f"{resident_model.FAILED_RETRY_MAX_SECS / 60:g} min)")
    times = {1.0: "once", 2.0: "twice", 4.0: "four times"}
    stated = [
        ("operating", backoff), ("architecture", backoff),
        ("errors", f"`model_loading` says {dispatch.LOAD_RETRY_AFTER_SECS} s and `model_failed` "
                   f"{dispatch.FAILED_RETRY_AFTER_SECS} s"),
        ("http", f"`Access-Control-Max-Age` {cors.MAX_AGE_SECS} s"),
        ("http", f"once {flow.PAUSE_TOKENS} of its tokens wait unsent"),
        ("grpc", f"once {flow.PAUSE_TOKENS} of its tokens wait unsent"),
        ("http", f"all but {flow.RESUME_TOKENS} of them"),
        ("grpc", f"all but {flow.RESUME_TOKENS} ("),
        ("http", f"about {selection.CHARS_PER_TOKEN} characters a token, plus "
                 f"{selection.TOKENS_PER_MESSAGE} per message"),
        ("errors", f"slower than {http_edge.MIN_BODY_BYTES_PER_SEC // 1024} KiB/s"),
        ("http", f"set to {client_stream.SEND_BUFFER_BYTES // 1024} KiB for event streams"),
        ("http", f"a piece at a time ({client_stream.WHOLE_CHUNK_BYTES // 1024} KiB"),
        ("operating", f"a margin of {memory_plan.MARGIN_FRACTION:.0%} of the card, at least "
                      f"{memory_plan.MARGIN_MIN_BYTES >> 20} MiB"),
        ("architecture", f"plus {times[inflight.PREFILL_MARGIN]} the prompt's tokens"),
    ]
    missing = [f"docs/{doc}.md: {text!r}" for doc, text in stated if text not in docs[doc]]
    assert not missing, "the docs no longer state the code's figure:\n" + "\n".join(missing)
