"""The documentation site builds with warnings as errors and holds what readers look for."""

from __future__ import annotations

import glob
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from omegaconf import OmegaConf

from tests.docs.blocks import REPO
from trainrun.runner.config import load_config
from trainrun.runner.reference import flat_keys

SPHINX = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
PAGES = ["index", "getting-started", "own-model", "configs", "config-reference", "strategies",
         "checkpoints", "cluster", "sweeps", "hooks-and-trackers", "data", "compile",
         "huggingface", "dist", "own-strategy", "architecture", "troubleshooting", "benchmarks",
         "cli", "api/index"]


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the whole session (pytest-xdist's workers share it: their
    temporary directories are beside each other in the session's)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "docs-site"
    with FileLock(str(shared / "docs-site.lock")):
        if not (out / "index.html").is_file():
            done = subprocess.run([*SPHINX, str(REPO / "docs"), str(out)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                pytest.fail(f"sphinx-build -W --keep-going -n failed:\n{done.stderr[-8000:]}")
    return out


def text_of(page: Path) -> str:
    """A built page's text, without its markup."""
    return html.unescape(re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8")))


def test_the_site_has_every_page(site: Path) -> None:
    missing = [page for page in PAGES if not (site / f"{page}.html").is_file()]
    assert not missing


def test_no_page_has_a_table_of_contents_of_its_own(site: Path) -> None:
    """Furo shows each page's headings beside it, and draws an error box over a page that
    has a contents directive as well."""
    pages = [str(page.relative_to(site)) for page in site.rglob("*.html")
             if 'class="contents' in page.read_text(encoding="utf-8")]
    assert pages == []


def test_every_key_of_a_shipped_config_is_on_the_site(site: Path) -> None:
    """Each key of each shipped config's resolved config.yaml, as a run writes it."""
    reference = text_of(site / "config-reference.html")
    missing = []
    for path in sorted(glob.glob(str(REPO / "configs" / "*.yaml"))):
        cfg = OmegaConf.to_container(load_config(path, on_warning=lambda _: None))
        missing += [f"{Path(path).name}: {key}" for key in flat_keys(cfg)
                    if key not in reference]
    assert not missing, "\n".join(missing)


def test_single_backticks_render_as_code(site: Path) -> None:
    """Docstrings name code between single backticks as often as between double ones; both
    render as code, none as a title in italics (docutils' default role)."""
    pages = [str(page.relative_to(site)) for page in site.rglob("*.html")
             if "<cite>" in page.read_text(encoding="utf-8")]
    assert pages == []


@pytest.mark.parametrize("page, names", [
    ("api/dist", ["trainrun.dist.init_dist", "trainrun.dist.all_reduce",
                  "trainrun.dist.collect_results", "trainrun.dist.master_only",
                  "trainrun.dist.BaseDistBackend"]),
    ("api/runner", ["trainrun.runner.runner.Runner", "trainrun.runner.runner.Runner.from_cfg",
                    "trainrun.wrappers.base_model.BaseModel",
                    "trainrun.runner.evaluation.BaseMetric", "trainrun.runner.hooks.base.Hook",
                    "trainrun.runner.hooks.ema.EMAHook",
                    "trainrun.runner.hooks.early_stopping.EarlyStoppingHook",
                    "trainrun.runner.hooks.profiler.ProfilerHook",
                    "trainrun.runner.trackers.Tracker"]),
    ("api/wrappers", ["trainrun.wrappers.base.Strategy",
                      "trainrun.wrappers.ddp.MMDistributedDataParallel",
                      "trainrun.wrappers.fsdp.MMFullyShardedDataParallel"]),
])
def test_the_api_reference_renders_the_docstrings(site: Path, page: str,
                                                   names: list[str]) -> None:
    """Each object has its entry (autodoc's anchor is its full name), with its arguments."""
    markup = (site / f"{page}.html").read_text(encoding="utf-8")
    assert [name for name in names if f'id="{name}"' not in markup] == []
    assert "Parameters" in text_of(site / f"{page}.html")  # napoleon's fields from Args:


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (make test's set-up installs it where "
                           "apt is there)")
def test_a_browser_shows_navigation_search_and_content(site: Path) -> None:
    """The home page and the tutorial, rendered in headless Chromium (tools/docs_check.py)."""
    done = subprocess.run([sys.executable, str(REPO / "tools" / "docs_check.py"), str(site)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (site / "_screenshots" / "index.png").is_file()
    assert (site / "_screenshots" / "own-model.png").is_file()
