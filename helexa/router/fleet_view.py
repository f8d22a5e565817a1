"""What /v1/models says of each model, summed over the healthy neurons that serve it READY.

Each function reads the registry's last reports (helexa/router/registry.py) and folds the
neurons' figures into the one a client can rely on: the smallest limits, the largest
per-request state, the prefix cache only where every neuron has it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from helexa.proto import neuron_pb2 as pb
from helexa.router.errors import bad_request
from helexa.router.registry import Registry

_LIMIT = re.compile(r"[0-9]{1,9}")  # the page size: ASCII decimal, int() of few digits


def _ready(registry: Registry) -> Iterator[pb.ModelStatus]:
    for link in registry.healthy_links():
        for m in link.status.models if link.status is not None else ():
            if m.state == pb.MODEL_STATE_READY:
                yield m


def ready_limits(registry: Registry) -> dict[str, tuple[int, int, int]]:
    """Model → (context, input, output), the smallest among healthy neurons serving it."""
    out: dict[str, tuple[int, int, int]] = {}
    for m in _ready(registry):
        lim = (m.limits.context, m.limits.input, m.limits.output)
        prev = out.get(m.model)
        out[m.model] = lim if prev is None else (
            min(prev[0], lim[0]), min(prev[1], lim[1]), min(prev[2], lim[2]))
    return out


def ready_state_costs(registry: Registry) -> dict[str, tuple[int, bool]]:
    """Model → (fixed bytes per request, prefix cache on): the largest figure, and on only
    where every neuron serving it has it on."""
    out: dict[str, tuple[int, bool]] = {}
    for m in _ready(registry):
        fixed, cache = m.limits.fixed_bytes_per_request, m.limits.prefix_cache
        prev = out.get(m.model)
        out[m.model] = (fixed, cache) if prev is None else (max(prev[0], fixed),
                                                            prev[1] and cache)
    return out


def prefix_sharing(registry: Registry) -> dict[str, str]:
    """Model → whose prefixes a request may reuse: "global" where any neuron serving it
    shares across principals (or is older than the field), else "principal"."""
    out: dict[str, str] = {}
    for m in _ready(registry):
        if out.get(m.model) != "global":
            out[m.model] = m.limits.prefix_sharing or "global"
    return out


def drafters(registry: Registry) -> dict[str, str]:
    """Model → the speculative drafter its ready neurons run (docs/speculation.md); "off"
    when none does, names joined with "," when neurons differ."""
    seen: dict[str, set[str]] = {}
    for m in _ready(registry):
        seen.setdefault(m.model, set()).add(m.drafter or "off")
    return {k: ",".join(sorted(v)) for k, v in seen.items()}


def models_taking_images(registry: Registry) -> set[str]:
    """Models a healthy neuron serves READY and says take images (a vision tower in Watch)."""
    return {m.model for m in _ready(registry) if m.HasField("vision")}


def created(registry: Registry, seen: dict[str, int]) -> dict[str, int]:
    """Model → its `created` (unix seconds): when the router first saw it READY, as the
    earliest neuron says it became ready (a neuron older than ready_unix_ms: that moment,
    now). The first answer stays, so a model's `created` does not move between calls
    while neurons come and go; `seen` keeps it (the router's, for its lifetime)."""
    ready: dict[str, int] = {}
    now = time.time()
    for m in _ready(registry):
        at = m.ready_unix_ms // 1000 if m.ready_unix_ms > 0 else int(now)
        ready[m.model] = min(at, ready.get(m.model, at))
    for model, at in ready.items():
        seen.setdefault(model, at)
    return seen


def rfc3339(unix_secs: int) -> str:
    """A `created` as Anthropic's `created_at` writes it."""
    return datetime.fromtimestamp(unix_secs, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_page(data: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of Anthropic's model list: `limit` (1 to 1,000, default 20) entries after
    `after_id` or before `before_id`, with `has_more`, `first_id` and `last_id`."""
    raw = query.get("limit", "20")
    # ASCII digits only, and few: str.isdigit() takes `²` and `١`, and int() of 5,000
    # digits raises; both are the same 400 as `limit=0`
    if not _LIMIT.fullmatch(raw) or not 1 <= int(raw) <= 1000:
        raise bad_request("`limit` must be an integer from 1 to 1000", "limit")
    limit, ids = int(raw), [e["id"] for e in data]
    for name in ("after_id", "before_id"):
        if name in query and query[name] not in ids:
            raise bad_request(f"`{name}`: no model `{query[name]}`", name)
    if "before_id" in query:
        end = ids.index(query["before_id"])
        page, more = data[max(0, end - limit):end], end > limit
    else:
        start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
        page, more = data[start:start + limit], start + limit < len(data)
    return {"data": page, "has_more": more, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
