"""A worker target for tests/data_tools/test_check.py, in a module of its own: a worker imports only this."""
import os
import signal
import time


def crash_or_stall(what: str) -> str:
    if what == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "stall":
        time.sleep(600)
    return what.upper()
