"""API keys → principals, from a keys file that stores only key hashes.

The keys file (`auth.keys_file` in the router config) is TOML with one
table, `keys`, mapping the hex SHA-256 of each API key to the principal it
acts for; several keys may map to one principal:

    # printf %s "$KEY" | sha256sum      (or: python -m helexa.router.auth KEY PRINCIPAL)
    [keys]
    "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae" = "alice"
    "fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9" = "ci"

A principal is a short name (letters, digits, `-`, `_`, `.`, `@`), used by
the neurons for fairness and per-principal caps and carried in logs; the
name `anonymous` is reserved for callers without a key. A request whose key
(`Authorization: Bearer <key>` or `x-api-key`) matches no entry is refused 401
naming the header, whether or not `auth.require_auth` is set: a mistyped key
served anonymously would lose its principal's limits, share and prefix cache
unseen. Without a key a caller is anonymous unless `auth.require_auth` is set.
A router with no keys at all (no `auth.keys_file`, as `helexa up` runs) and
`require_auth` off serves every key anonymously: the SDKs and agents need some
key to start, and docs/operating.md tells them any value does. The principal
comes only from this table: any principal header a client sends is ignored.
`python -m helexa.router.auth KEY PRINCIPAL` prints the line to add.
SIGHUP re-reads the file.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

from multidict import CIMultiDictProxy

from helexa.config.schema import ConfigError, read_toml
from helexa.router.errors import ApiError

ANONYMOUS = "anonymous"
_PRINCIPAL = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys_file(path: str | Path) -> dict[str, str]:
    """Parse a keys file into {sha256 hex: principal}; ConfigError names the bad line."""
    path = Path(path)
    raw = read_toml(path)
    extra = set(raw) - {"keys"}
    if extra:
        raise ConfigError(f"{path}: {sorted(extra)[0]}: unknown key; expected only [keys]")
    keys = raw.get("keys", {})
    if not isinstance(keys, dict):
        raise ConfigError(f"{path}: keys: expected a table of sha256 hex = principal")
    out: dict[str, str] = {}
    for digest, principal in keys.items():
        if not _HEX64.match(digest.lower()):
            raise ConfigError(f"{path}: keys.{digest}: expected 64 hex digits (sha256 of the key)")
        if not isinstance(principal, str) or not _PRINCIPAL.match(principal) \
                or principal == ANONYMOUS:
            raise ConfigError(f"{path}: keys.{digest}: expected a principal name "
                              f"(letters, digits, -_.@; not `{ANONYMOUS}`), got {principal!r}")
        out[digest.lower()] = principal
    return out


class Authenticator:
    """Turns an Authorization header into a principal, or refuses (401)."""

    def __init__(self, hashed_keys: dict[str, str] | None = None, require_auth: bool = False) -> None:
        self.hashed_keys = dict(hashed_keys or {})
        self.require_auth = require_auth

    def principal(self, authorization: str | None, header: str = "Authorization") -> str:
        """The principal for a request's Authorization header (ANONYMOUS when none); `header`:
        the one the key came in, as a 401 names it."""
        key = None
        if authorization:
            scheme, _, rest = authorization.partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                key = rest.strip()
        if key is not None:
            # Looking up the digest (not the key) leaks nothing useful through timing.
            principal = self.hashed_keys.get(hash_key(key))
            if principal is not None:
                return principal
            if self.hashed_keys or self.require_auth:  # a key, and not one of ours
                raise ApiError(401, "invalid x-api-key: it matches no key of this router"
                               if header == "x-api-key" else "Incorrect API key provided in "
                               f"the {header} header: it matches no key of this router",
                               code="invalid_api_key")
            return ANONYMOUS  # a router without keys: any key will do (module docstring)
        if self.require_auth:
            raise ApiError(401, "Missing API key (Authorization: Bearer)", code="invalid_api_key")
        return ANONYMOUS

    def of(self, headers: CIMultiDictProxy[str]) -> str:
        """The principal of a request's headers (authorization(); a 401 names the header)."""
        return self.principal(authorization(headers), key_header(headers))


def key_header(headers: CIMultiDictProxy[str]) -> str:
    """The header the caller's key came in, as a refusal names it."""
    return "x-api-key" if any(headers.getall("x-api-key", [])) else "Authorization"



def authorization(headers: CIMultiDictProxy[str]) -> str | None:
    """The caller's key as an Authorization header: its `Authorization: Bearer`, or
    Anthropic's `x-api-key`. Two different keys (one in each, or a header given twice with
    two values) are refused 400 naming the headers, not one picked: each API honours its
    own header (OpenAI Authorization, Anthropic x-api-key), so a pick would run someone's
    call as the other key, and RFC 6750 (section 3.1) makes a token sent more than one way
    an invalid_request. The same key in both is one key."""
    auths = set(headers.getall("Authorization", []))
    keys = {k for k in headers.getall("x-api-key", []) if k}
    for name, values in (("Authorization", auths), ("x-api-key", keys)):
        if len(values) > 1:
            raise ApiError(400, f"{name}: given {len(values)} times with different values;"
                           " send one key", code="invalid_request_error")
    header = next(iter(auths), None)
    if not keys:
        return header
    key = next(iter(keys))
    scheme, _, bearer = (header or "").partition(" ")
    if scheme.lower() == "bearer" and bearer.strip() and bearer.strip() != key:
        raise ApiError(400, "x-api-key and Authorization: Bearer carry two different keys;"
                       " send one of them", code="invalid_request_error")
    return f"Bearer {key}"


def may_load(principal: str, load_principals: list[str]) -> bool:
    """Whether this principal may cause an on-demand model load (`auth.load_principals`)."""
    return "*" in load_principals or principal in load_principals


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m helexa.router.auth KEY PRINCIPAL", file=sys.stderr)
        return 2
    print(f'"{hash_key(argv[0])}" = "{argv[1]}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
