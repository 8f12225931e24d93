"""Test helper (on PYTHONPATH of the app server that tests/app/test_app_browser.py starts): with
JAXSORA_TEST_CONNECTIONS=FILE, every connection or name look-up the process makes to anything but this machine is
appended to FILE, from Python's audit events (socket.connect, socket.getaddrinfo), which every socket of the
standard library and of the packages built on it (httpx, urllib3, asyncio) raises."""
import os
import sys

_LOG = os.environ.get("JAXSORA_TEST_CONNECTIONS")
_LOCAL = ("127.", "localhost", "::1", "0.0.0.0", "::")


def _host(event, args):
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, (str, bytes)):  # a unix socket: a path on this machine
            return None
        return address[0]
    if event == "socket.getaddrinfo":
        return args[0]
    return None


def _hook(event, args):
    if event not in ("socket.connect", "socket.getaddrinfo"):
        return
    host = _host(event, args)
    host = host.decode() if isinstance(host, bytes) else host
    if host is None or str(host).startswith(_LOCAL) or host == "":
        return
    with open(_LOG, "a") as f:
        f.write(f"{event} {host}\n")


if _LOG:
    sys.addaudithook(_hook)
