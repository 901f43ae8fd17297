"""Open the built documentation site in headless Chromium, as a reader would see it.

    python tools/docs_check.py [SITE]        (make docs-check; SITE defaults to site/)

Takes screenshots of the home page and the tutorial into SITE/_screenshots/, and checks in
the rendered pages (after their scripts ran) that each shows the navigation, the search box
and its content, and that a search finds pages. Exit 0 when all holds, 1 naming what does
not, 2 when Chromium is not installed (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the pages a newcomer opens first, and a word each must show
PAGES = {"index": "Where to start", "own-model": "BlobNet"}
SEARCH = ("resume", "checkpoints.html")  # a query, and a page its results must link to
# Chromium as root in a container, with nothing fetched from the network
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=8000"]
SIZE = (1280, 1000)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(browser: str, url: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args, url],
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed on {url} (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return done.stdout


def rendered(browser: str, url: str) -> str:
    """The page's DOM after its scripts ran."""
    return run_chromium(browser, url, "--dump-dom")


def screenshot(browser: str, url: str, out: Path) -> None:
    run_chromium(browser, url, f"--screenshot={out}", f"--window-size={SIZE[0]},{SIZE[1]}")
    if not out.is_file():
        raise RuntimeError(f"chromium wrote no screenshot of {url}")


def looks_drawn(png: Path) -> bool:
    """Whether a screenshot holds more than one colour (a blank page would not)."""
    from matplotlib.image import imread

    pixels = imread(png)
    return float(pixels.std()) > 0.01


def page_problems(dom: str, page: str, word: str) -> list[str]:
    problems = []
    if 'class="sidebar-tree"' not in dom or dom.count("reference internal") < 10:
        problems.append(f"{page}: no navigation (the sidebar's table of contents)")
    if 'class="sidebar-search"' not in dom:
        problems.append(f"{page}: no search box")
    article = re.search(r"<article[^>]*>(.*?)</article>", dom, re.S)
    if article is None or word not in article.group(1) or "<h1" not in article.group(1):
        problems.append(f"{page}: its content (a title and {word!r}) is not shown")
    return problems


def check(site: Path) -> list[str]:
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    shots = site / "_screenshots"
    shots.mkdir(exist_ok=True)
    problems = []
    for page, word in PAGES.items():
        if not (site / f"{page}.html").is_file():
            problems.append(f"{page}: {page}.html is not in the site")
            continue
        url = (site / f"{page}.html").resolve().as_uri()
        problems += page_problems(rendered(browser, url), page, word)
        png = shots / f"{page}.png"
        screenshot(browser, url, png)
        if not looks_drawn(png):
            problems.append(f"{page}: the screenshot {png} is blank")
    query, expected = SEARCH
    results = rendered(browser, (site / "search.html").resolve().as_uri() + f"?q={query}")
    if expected not in results:
        problems.append(f"search: '{query}' found no link to {expected}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="site", type=Path, help="the built site")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"error: {args.site}/index.html not found: build the site first (make docs)",
              file=sys.stderr)
        return 2
    try:
        problems = check(args.site)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"docs-check: {problem}", file=sys.stderr)
    if not problems:
        print(f"docs-check: navigation, search and content shown; screenshots in "
              f"{args.site / '_screenshots'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
