"""Shared fixtures. Prefect's home goes to a temporary folder before prefect is imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="capo-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_API_URL", "")  # never talk to a developer's running server

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("CAPO_DATA_DIR", REPO / "data")).resolve()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The project's data dir (embedded models and prompts are converted once and reused)."""
    return DATA
