"""The process's file-descriptor limit: raised to its hard limit at start, and read.

Every socket a daemon holds is a file descriptor: a client's connection, a
neuron link, the log, a file read on reload. Linux hosts often start a
process with a soft RLIMIT_NOFILE of 1,024 under a far higher hard limit;
past the soft one accept() fails, and so does everything else the daemon
opens (docs/http.md, "Connections"). The router and the neuron raise the
soft limit to the hard one as they start (as vLLM's servers do), which any
process may, and log both figures (`process.fd_limit`).
"""

from __future__ import annotations

import resource


def fd_limit() -> int:
    """The file descriptors this process may hold now (its soft RLIMIT_NOFILE)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> dict[str, int | str]:
    """Raise the soft RLIMIT_NOFILE to the hard one; the figures for the daemon's
    `process.fd_limit` line: `limit` (soft now), `soft_before`, `hard`. A hard limit of
    "unlimited" (not Linux's) or a refusal leaves the soft one as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return {"limit": fd_limit(), "soft_before": soft,
            "hard": "unlimited" if hard == resource.RLIM_INFINITY else hard}
