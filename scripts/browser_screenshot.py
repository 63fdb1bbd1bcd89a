"""Screenshot a critique browser page in headless Chromium (the README's picture).

    python scripts/browser_screenshot.py runs/<run>/browse/round_001-<variant>/index.html docs/img/browser.png \
        [--filter wrong_unflagged] [--width 1400] [--height 1000]

Checks the filter, clicks the first flagged step of the first response shown (opening its
critiques), and saves a PNG. Needs Chromium (Debian's ``chromium``) and ``playwright``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.browse import headless_chromium


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--filter", default="all", choices=["all", "wrong_unflagged", "right_flagged", "split", "parse_failures"],
                    help="the browser filter to check before the screenshot")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1000)
    a = ap.parse_args()
    with headless_chromium() as browser:  # RuntimeError naming the fix where Chromium is missing
        page = browser.new_page(viewport={"width": a.width, "height": a.height})
        page.goto(a.page.resolve().as_uri())
        page.check(f"input[name=filter][value={a.filter}]")
        visible = page.locator(".response:not(.hidden)")
        if visible.count():
            steps = visible.first.locator(".step.flagged")
            (steps.first if steps.count() else visible.first.locator(".step").first).click()
            visible.first.scroll_into_view_if_needed()
        a.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(a.out))
    print(a.out)


if __name__ == "__main__":
    main()
