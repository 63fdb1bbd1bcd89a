"""The unit tier runs offline and installs nothing: every test here is refused a connection to a
host other than this machine and a ``pip install`` through ``subprocess.run`` (what fetching an
embedded asset does), and its child processes get no package index and no model hub, so a
test that would need the network or a package fails here instead of passing only where one is
reachable. Tests that need the embedded models or data sets belong in ``tests/stages``."""

from __future__ import annotations

import ipaddress
import socket
import subprocess

import pytest

_connect = socket.socket.connect


def _local(address) -> bool:
    if not isinstance(address, tuple):  # a Unix socket path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    def connect(sock, address):
        if not _local(address):
            raise RuntimeError(f"the unit tier runs offline: a test tried to connect to {address!r}; "
                               "a test that needs the network or an embedded asset belongs in tests/stages")
        return _connect(sock, address)

    run = subprocess.run

    def no_pip(args, *a, **kw):
        argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else [args])]
        if any(x == "pip" or x.endswith("/pip") for x in argv) and "install" in argv:
            raise RuntimeError(f"the unit tier installs nothing: a test ran {' '.join(argv)!r}; "
                               "a test that needs an embedded asset belongs in tests/stages")
        return run(args, *a, **kw)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(subprocess, "run", no_pip)
    # child processes (``capo`` commands some tests start) inherit these: no package index, no model hub
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

