"""The documentation site as a reader gets it: ``mkdocs build --strict`` (a broken link, a missing
page, a page left out of the navigation or a docstring mkdocstrings cannot render fails the build),
then every page of the navigation opened in headless Chromium over HTTP, and the navigation clicked
from the home page to each page.

About 30 seconds on 2 cores (most of it the API reference's docstrings)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import yaml


def _pages(nav) -> list[tuple[str, str]]:
    """(title, docs path) of every page in mkdocs.yml's ``nav``, in order."""
    out: list[tuple[str, str]] = []
    for item in nav:
        if isinstance(item, str):
            out.append((item, item))
            continue
        for title, value in item.items():
            out.extend(_pages(value) if isinstance(value, list) else [(title, value)])
    return out


def _url(page: str) -> str:
    """The page's URL under mkdocs' default directory URLs: ``a.md`` -> ``a/``, ``index.md`` -> ``''``."""
    stem = page[:-3]
    return "" if stem == "index" else f"{stem}/"


@pytest.fixture(scope="module")
def site(repo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(repo / "mkdocs.yml"),
                          "-d", str(out)], cwd=repo, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def nav(repo) -> list[tuple[str, str]]:
    cfg = yaml.load((repo / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    return _pages(cfg["nav"])


def test_every_docs_page_is_in_the_navigation(repo, nav):
    in_nav = {p for _, p in nav}
    on_disk = {str(p.relative_to(repo / "docs")) for p in (repo / "docs").rglob("*.md")}
    assert on_disk == in_nav, f"not in nav: {sorted(on_disk - in_nav)}; in nav, no file: {sorted(in_nav - on_disk)}"


def test_the_site_builds_strict_with_every_page(site, nav):
    for _, page in nav:
        html = site / _url(page) / "index.html"
        assert html.is_file(), f"{page} was not rendered ({html})"
    api = (site / "api" / "index.html").read_text()
    assert "doc-function" in api or "doc-class" in api, "the API reference rendered no docstring"


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a, **k):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_every_page_loads_and_the_navigation_reaches_it_in_chromium(served, nav):
    from pipeline.browse import headless_chromium
    from tests.conftest import require_chromium

    require_chromium()
    with headless_chromium() as browser:
        page = browser.new_page()
        # the site loads MathJax from a CDN, which an offline machine cannot reach: answer it empty
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(served)
                   else route.fulfill(status=200, body=""))
        for title, path in nav:
            resp = page.goto(served + _url(path))
            assert resp is not None and resp.ok, f"{path}: HTTP {resp and resp.status}"
            assert page.locator("article h1").count() >= 1, f"{path} has no title"
            assert page.locator("article").inner_text().strip(), f"{path} is empty"
        # the navigation: from the home page, each entry's link leads to its page
        for title, path in nav[1:]:
            page.goto(served)
            link = page.locator(f'nav.md-nav--primary a.md-nav__link[href$="{_url(path)}"]').first
            assert link.count() == 1, f"the navigation has no link to {path}"
            link.click()
            page.wait_for_url(served + _url(path), timeout=15_000)  # raises, naming the URL, if the link goes elsewhere
