"""SIGHUP is all or nothing: a config that cannot be applied whole leaves the running one
serving, links and all."""

from __future__ import annotations

import tomllib

import structlog.testing
import tomli_w

MSG = [{"role": "user", "content": "hello there"}]


def reload_with(fl, tmp_path, raw: bytes) -> None:
    cfg = tmp_path / "router.toml"
    cfg.write_bytes(raw)
    old_path = fl.state.config_path
    fl.state.config_path = cfg
    try:
        fl.lt.run(fl.state.reload())
    finally:
        fl.state.config_path = old_path


def test_a_reload_naming_a_missing_ca_file_keeps_the_old_links_serving(fl, tmp_path):
    links = dict(fl.state.registry.links)
    raw = tomli_w.dumps({
        "aliases": {"helexa/new": "tiny"},
        "neurons": {"token_file": str(fl.state.config_path.parent / "token"), "endpoints": [
            {"name": "n1", "address": fl.n1.address, "tls": True, "ca_file": "absent-ca.pem"},
            {"name": "n2", "address": fl.n2.address, "tls": True, "ca_file": "absent-ca.pem"},
            {"name": "n3", "address": "127.0.0.1:1"}]}}).encode()
    reload_with(fl, tmp_path, raw)
    assert fl.state.registry.links == links  # the very same links, still running
    assert all(link.task is not None and not link.task.done() for link in links.values())
    assert "helexa/new" not in dict(fl.state.aliases.items())  # nothing of it was applied
    fl.wait_healthy()
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert r.choices[0].message.content == "w0 "


def test_a_reload_of_a_file_that_is_not_utf8_keeps_serving(fl, tmp_path):
    links = dict(fl.state.registry.links)
    reload_with(fl, tmp_path, b'[aliases]\n"\xff" = "tiny"\n')
    assert fl.state.registry.links == links
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert r.choices[0].message.content == "w0 "



def test_a_reload_with_an_alias_chain_is_refused_and_the_old_aliases_serve(fl, tmp_path):
    before = fl.state.aliases.items()
    current = tomllib.loads(fl.state.config_path.read_text())
    chain = {"helexa/quick": "tiny", "helexa/fast": "helexa/quick"}
    reload_with(fl, tmp_path, tomli_w.dumps({**current, "aliases": chain}).encode())
    assert fl.state.aliases.items() == before
    r = fl.client().chat.completions.create(model="helexa/balanced", messages=MSG, max_tokens=1)
    assert r.choices[0].message.content == "w0 "
    chain.pop("helexa/fast")  # the same file less the chain applies: the chain was the fault
    try:
        reload_with(fl, tmp_path, tomli_w.dumps({**current, "aliases": chain}).encode())
        assert fl.state.aliases.items() == [("helexa/quick", "tiny")]
    finally:  # the fleet is the session's: its own config again
        fl.lt.run(fl.state.reload())
    assert fl.state.aliases.items() == before


def test_a_reload_that_changes_the_keepalive_rebuilds_the_links_with_it(fl, tmp_path):
    links = dict(fl.state.registry.links)
    current = tomllib.loads(fl.state.config_path.read_text())
    timeouts = current.get("timeouts", {})
    reload_with(fl, tmp_path, tomli_w.dumps(current).encode())
    assert fl.state.registry.links == links  # nothing changed: the very same links
    try:
        reload_with(fl, tmp_path, tomli_w.dumps({**current, "timeouts": {
            **timeouts, "keepalive_secs": 7.0, "keepalive_timeout_secs": 4.0}}).encode())
        new = fl.state.registry.links
        assert new.keys() == links.keys() and not set(new.values()) & set(links.values())
        assert {(link.settings.keepalive_secs, link.settings.keepalive_timeout_secs)
                for link in new.values()} == {(7.0, 4.0)}
        fl.wait_healthy()
        r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        assert r.choices[0].message.content == "w0 "
    finally:
        reload_with(fl, tmp_path, tomli_w.dumps(current).encode())
        fl.wait_healthy()


def test_a_reload_names_the_fields_that_wait_for_a_restart_and_applies_the_rest(fl, tmp_path):
    """Which fields wait is read off the schema's marks (docs/config.md, "apply"), not a list
    kept by hand: server.max_body_bytes and limits.schema_workers wait, and are named;
    limits.max_tools, the connection cap and the CORS origins apply at once. They wait until
    a restart: a second reload names them again, and the started file's values none."""
    current = tomllib.loads(fl.state.config_path.read_text())
    server, limits = current.get("server", {}), current.get("limits", {})
    changed = {**current,
               "server": {**server, "max_body_bytes": 4 * 1024 * 1024, "max_connections": 900,
                          "cors_allowed_origins": ["https://app.example.com"]},
               "limits": {**limits, "schema_workers": 3, "max_tools": 7}}

    def waiting() -> list[list[str]]:
        return [e["fields"] for e in logs if e["event"] == "config.restart_needed"]
    try:
        with structlog.testing.capture_logs() as logs:
            reload_with(fl, tmp_path, tomli_w.dumps(changed).encode())
        assert waiting() == [["limits.schema_workers", "server.max_body_bytes"]], logs
        assert fl.state.caps.max_tools == 7 and fl.state.cfg.limits.max_tools == 7
        assert fl.state.connections.max_connections == 900
        assert fl.state.cfg.server.cors_allowed_origins == ["https://app.example.com"]
        with structlog.testing.capture_logs() as logs:  # the same file again: still waiting
            reload_with(fl, tmp_path, tomli_w.dumps(changed).encode())
        assert waiting() == [["limits.schema_workers", "server.max_body_bytes"]], logs
    finally:
        with structlog.testing.capture_logs() as logs:  # the session's own config again
            fl.lt.run(fl.state.reload())
    assert waiting() == [], logs  # what it started with: nothing waits
    assert fl.state.cfg.limits.max_tools == limits.get("max_tools", 128)
