"""Triton's interpreter, flame's CPU backend: one speed fix.

Every call of a ``@triton.jit`` helper from inside a kernel makes the interpreter patch the
language modules the helper's module sees (``triton.language``, ``triton.language.core``) for the
interpreter's semantics: a walk of every member of those modules, about a millisecond each time,
although the launch running the kernel patched the same modules for its whole grid already.
flame's kernels call small helpers several times per program (``tile_4d``, ``offsets_4d``, the
operand loads and stores), so on the interpreter that repeated patching was a quarter of the time
of a training step. ``install()`` skips it for a helper whose language modules the running launch
has patched; a helper that sees another one (``tl.randn`` lives in ``triton.language.random``,
which sees ``triton.language.core``) is patched as before, once per launch. Results are unchanged:
only work that would set the same attributes to the same values again is left out.

Where Triton's interpreter lacks the internals this relies on (another release), ``install()``
leaves it as it is and returns False.
"""
from __future__ import annotations

import inspect
import threading

import triton.language as tl

_LANGUAGES = (tl, tl.core)
_languages_of: dict = {}  # a jit function -> ids of the language modules its globals hold
_running = threading.local()  # .patched: per launch running on this thread, the ids of the modules patched


def _languages(fn) -> frozenset:
    found = _languages_of.get(fn)
    if found is None:
        found = _languages_of[fn] = frozenset(
            id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in _LANGUAGES)
    return found


def _patched() -> list:
    stack = getattr(_running, "patched", None)
    if stack is None:
        stack = _running.patched = []
    return stack


def install() -> bool:
    """Make helper calls inside a running interpreter launch skip re-patching the language modules
    that launch patched. Idempotent; False (nothing changed) where the internals differ."""
    try:
        from triton.runtime import interpreter as interp
        run_grid, call_helper = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__
        error = interp.InterpreterError
    except (ImportError, AttributeError):
        return False
    if not hasattr(interp.InterpretedFunction, "rewrite"):
        return False
    if getattr(call_helper, "flame_installed", False):
        return True

    def grid_call(self, *args, **kwargs):  # a launch: it patches its kernel's language modules
        stack = _patched()
        stack.append(set(_languages(self.fn)))
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper_call(self, *args, **kwargs):
        stack, languages = _patched(), _languages(self.fn)
        if not stack or not languages <= stack[-1]:
            if stack:
                stack[-1] |= languages
            return call_helper(self, *args, **kwargs)
        try:  # what the interpreter's own helper call does after patching
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    helper_call.flame_installed = True
    interp.GridExecutor.__call__ = grid_call
    interp.InterpretedFunction.__call__ = helper_call
    return True
