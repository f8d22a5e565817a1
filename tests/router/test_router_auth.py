"""Keys file parsing and key → principal resolution."""

from __future__ import annotations

import pytest

from helexa.config.schema import ConfigError
from helexa.router.auth import ANONYMOUS, Authenticator, hash_key, load_keys_file, may_load
from helexa.router.errors import ApiError


def test_keys_file_maps_hashes_to_principals(tmp_path):
    f = tmp_path / "keys.toml"
    f.write_text(f'[keys]\n"{hash_key("k1")}" = "alice"\n"{hash_key("k2").upper()}" = "bob"\n')
    keys = load_keys_file(f)
    auth = Authenticator(keys, require_auth=True)
    assert auth.principal("Bearer k1") == "alice"
    assert auth.principal("bearer  k2 ") == "bob"
    assert "k1" not in f.read_text()  # only hashes are stored


@pytest.mark.parametrize("text,where", [
    ('[keys]\n"abc" = "alice"\n', "keys.abc"),
    (f'[keys]\n"{hash_key("x")}" = "anonymous"\n', "anonymous"),
    (f'[keys]\n"{hash_key("x")}" = "has space"\n', "principal"),
    ('other = 1\n', "other"),
    ('[keys\n', "syntax"),
])
def test_bad_keys_file_names_the_problem(tmp_path, text, where):
    f = tmp_path / "keys.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_keys_file(f)
    assert str(f) in str(e.value) and where in str(e.value)


def test_require_auth_refuses_missing_or_unknown_keys_401():
    auth = Authenticator({hash_key("good"): "alice"}, require_auth=True)
    for header in (None, "", "Bearer wrong", "Basic Z29vZA=="):
        with pytest.raises(ApiError) as e:
            auth.principal(header)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")


def test_without_require_auth_keyless_callers_are_anonymous_and_wrong_keys_401():
    auth = Authenticator({hash_key("good"): "alice"}, require_auth=False)
    assert auth.principal(None) == ANONYMOUS
    assert auth.principal("Bearer good") == "alice"
    for header in ("Authorization", "x-api-key"):  # a typo'd key: not silently anonymous
        with pytest.raises(ApiError) as e:
            auth.principal("Bearer sk-whatever", header)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
        assert header in e.value.message
    # a router with no keys at all (`helexa up`): any key is anonymous (docs/operating.md)
    assert Authenticator({}, require_auth=False).principal("Bearer sk-whatever") == ANONYMOUS


def test_may_load():
    assert may_load("x", ["*"])
    assert may_load("alice", ["alice"]) and not may_load("bob", ["alice"])
    assert may_load("anonymous", ["anonymous"]) and not may_load("anonymous", [])


def test_by_default_only_named_principals_cause_loads(tmp_path):
    from helexa.config.schema import load_router_config

    f = tmp_path / "router.toml"
    f.write_text('[server]\nlisten = "127.0.0.1:0"\n')
    default = load_router_config(f).auth.load_principals
    assert not may_load(ANONYMOUS, default) and not may_load("alice", default)
    f.write_text('[auth]\nload_principals = ["alice"]\n')
    named = load_router_config(f).auth.load_principals
    assert may_load("alice", named) and not may_load(ANONYMOUS, named)


def test_the_key_comes_from_one_header_and_two_different_keys_are_refused():
    from multidict import CIMultiDict, CIMultiDictProxy

    from helexa.router.auth import authorization

    def of(*pairs: tuple[str, str]) -> str | None:
        return authorization(CIMultiDictProxy(CIMultiDict(pairs)))

    assert of() is None
    assert of(("Authorization", "Bearer a")) == "Bearer a"
    assert of(("x-api-key", "a")) == "Bearer a"
    assert of(("x-api-key", "a"), ("Authorization", "Bearer a")) == "Bearer a"
    # a non-bearer Authorization carries no key: x-api-key's is the one
    assert of(("x-api-key", "a"), ("Authorization", "Basic Z29vZA==")) == "Bearer a"
    assert of(("Authorization", "Bearer a"), ("Authorization", "Bearer a")) == "Bearer a"
    conflicts = [([("x-api-key", "a"), ("Authorization", "Bearer b")], "x-api-key"),
                 ([("Authorization", "Bearer a"), ("Authorization", "Bearer b")], "Authorization"),
                 ([("x-api-key", "a"), ("x-api-key", "b")], "x-api-key")]
    for pairs, named in conflicts:
        with pytest.raises(ApiError) as e:
            of(*pairs)
        assert (e.value.status, e.value.code) == (400, "invalid_request_error")
        assert named in e.value.message
