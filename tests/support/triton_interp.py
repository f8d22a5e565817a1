"""Triton's interpreter (TRITON_INTERPRET=1, how the tests run helexa's and fla's Triton
kernels on CPU) without the work it repeats for nothing: computing the same values.

Each call of a ``@triton.jit`` helper from inside a kernel (fla's kernels make thousands)
makes the interpreter patch triton.language again: ``_patch_builtin`` walks every member
of ``tl``, ``tl.tensor``, ``tl.math``... with ``inspect.getmembers`` to wrap its builtins.
The launch around the call has already wrapped them all, so the walk finds no builtin left
and changes nothing, yet it was ~30% of tests/support/fla_real.py's CPU time (Triton
3.9). ``faster_device_calls`` skips a walk over a package whose builtins are wrapped
at that moment: a launch's wrapping still happens, and is undone when the launch ends,
exactly as before."""

from __future__ import annotations

from typing import Any


def faster_device_calls() -> bool:
    """Install the skip (once); False, changing nothing, where this Triton's interpreter
    is not the one described above."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_builtin", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_cls is None or not hasattr(scope_cls, "restore"):
        return False
    if getattr(patch, "skips_wrapped", False):
        return True
    wrapped: dict[Any, Any] = {}  # package -> the scope that wrapped its builtins
    restore = scope_cls.restore

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        if pkg in wrapped:  # already wrapped: the walk would find nothing to wrap
            return
        patch(pkg, builder, scope)
        wrapped[pkg] = scope

    def restore_scope(self: Any) -> None:
        restore(self)
        for pkg in [p for p, s in wrapped.items() if s is self]:
            del wrapped[pkg]  # unwrapped again: the next launch walks it

    patch_builtin.skips_wrapped = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = patch_builtin
    scope_cls.restore = restore_scope
    return True
