"""Triton's interpreter, less its repeated work: a test-run speed-up that leaves what it computes unchanged.

Under TRITON_INTERPRET=1 every call of a @triton.jit helper inside a kernel re-patches the triton.language
modules it sees (inspect.getmembers over each, and fresh closures for the functions it replaces), though the
launch patched them when it began and a nested call's patches are never undone: a third of the time of a
whole-model test through the interpreted kernels (tests/cache/test_kivi.py::test_whole_step_equals_eager). Here a
nested call patches only the language modules this launch has not patched yet; the launch's own patching and its
restore are Triton's. Where Triton's interpreter lacks the functions this wraps, nothing changes."""

import inspect
import os


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is on: Triton's kernels run in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def skip_repeated_patching() -> None:
    """Install the skip where TRITON_INTERPRET is on (call it before the first kernel runs)."""
    if not interpreting():
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None or getattr(patch, "skips_repeats", False):
        return
    import triton.language as tl

    patched: set[str] = set()          # the language modules patched since the running launch began
    running = [False]

    def langs(fn) -> frozenset[str]:
        return frozenset(value.__name__ for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_once(fn):
        seen = langs(fn)
        if running[0] and seen <= patched:
            return interpreter._LangPatchScope()                   # nothing to restore
        scope = patch(fn)
        patched.update(seen)
        return scope

    run = launch.__call__

    def call(self, *args, **kwargs):
        patched.clear()
        running[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            running[0] = False
            patched.clear()

    patch_once.skips_repeats = True
    patch_once.plain, call.plain = patch, run          # Triton's own, for tests/kernels/test_interpreted.py
    interpreter._patch_lang = patch_once
    launch.__call__ = call
