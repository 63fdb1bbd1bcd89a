"""The unit tier's guard (tests/unit/conftest.py): no connection off this machine, no pip install."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def test_the_unit_tier_is_offline():
    with pytest.raises(RuntimeError, match="runs offline"):
        socket.create_connection(("192.0.2.1", 80), timeout=1)  # TEST-NET-1: never routed
    with pytest.raises(RuntimeError, match="installs nothing"):
        subprocess.run([sys.executable, "-m", "pip", "install", "nothing-here"])
