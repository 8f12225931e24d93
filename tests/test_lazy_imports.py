"""`jaxsora.lazy_imports.install`: etils' lazy imports stay in the thread that asked for them. Each case runs
in a fresh interpreter (install changes `builtins.__import__` for good), with the two threads put in the
failing order by events, so the outcome does not depend on timing."""
import subprocess
import sys
import textwrap

from tests.conftest import REPO

RACE = textwrap.dedent("""
    import sys, threading
    from etils import epy
    if sys.argv[1] == "install":
        from jaxsora.lazy_imports import install
        install()
    inside, imported, seen = threading.Event(), threading.Event(), []

    def checkpoint_thread():  # what orbax's thread did: humanize's `from math import log`, then log(...)
        inside.wait()
        from math import log
        seen.append(type(log).__name__)
        imported.set()

    t = threading.Thread(target=checkpoint_thread)
    t.start()
    with epy.lazy_imports():  # what grain's import does on the main thread
        inside.set()
        imported.wait(10)
        import json
        seen.append(type(json).__name__)
    t.join()
    # nested and interleaved blocks in two threads leave the real import in place
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def block_a():
        with epy.lazy_imports():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    ta = threading.Thread(target=block_a)
    ta.start()
    a_in.wait(10)
    with epy.lazy_imports():
        b_in.set()
        a_out.wait(10)
    ta.join()
    import csv
    seen.append(type(csv).__name__)
    print(" ".join(seen))
""")


def _race(mode: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", RACE, mode], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split()


def test_a_lazy_import_block_does_not_reach_other_threads():
    # without install: the other thread's `from math import log` gets an unloaded module (the crash seen),
    # and two interleaved blocks leave every later import lazy
    assert _race("plain") == ["LazyModule", "LazyModule", "LazyModule"]
    # installed: the other thread imports for real, the block's own import is still lazy, nothing leaks
    assert _race("install") == ["builtin_function_or_method", "LazyModule", "module"]
