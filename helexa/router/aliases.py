"""Model aliases such as `helexa/balanced` → a concrete model id, from the router config.

Aliases are resolved once, at the router, before selection; neurons only
ever see concrete model ids. An alias may not point at another alias nor at
itself: RouterConfig refuses such a table (helexa/config/router.py,
`alias_problem`), so `helexa config check` says what the router would.
"""

from __future__ import annotations

from collections.abc import Mapping

from helexa.router.errors import ApiError


class Aliases:
    """An immutable alias table; SIGHUP swaps in a new one."""

    def __init__(self, table: Mapping[str, str] | None = None) -> None:
        self._table = dict(table or {})

    def resolve(self, name: str) -> str:
        """The model id a client's `model` names (itself when it is not an alias)."""
        return self._table.get(name, name)

    def is_alias(self, name: str) -> bool:
        return name in self._table

    def items(self) -> list[tuple[str, str]]:
        return sorted(self._table.items())

    def targets(self) -> set[str]:
        return set(self._table.values())

    def named(self, err: ApiError, asked: str) -> ApiError:
        """`err` as the client who asked for `asked` reads it: where `asked` is an alias
        whose target does not exist (model_not_found), the 404 names both, so the client
        sees the name it sent and the operator the target to fix in [aliases]."""
        target = self._table.get(asked)
        if target is None or err.code != "model_not_found":
            return err
        return ApiError(404, f"The model `{asked}` is an alias of `{target}`, which does not "
                             "exist", code="model_not_found", param="model")
