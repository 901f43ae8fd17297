"""Every shell command and Python block of the README and the docs runs here, or says why not.

Each page's blocks run in order in a temporary directory of their own (see ``blocks.py``), so a
renamed key, flag or file breaks a test instead of a reader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import NOT_RUN_ALIASES, PAGES, REPO, RUN, blocks, runnable_pages

BIN = Path(sys.executable).parent
BLOCK_TIMEOUT = 600  # seconds; a block this slow would not be in the docs


def test_every_shell_and_python_block_runs_or_says_why() -> None:
    problems = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang in NOT_RUN_ALIASES:
                problems.append(f"{block.where}: a {block.lang!r} block; write it as "
                                f"{' or '.join(RUN)} so that it runs (or says why not)")
            if block.lang in (*RUN, "yaml") and block.first_line.startswith("# not tested") \
                    and block.not_tested is None:
                problems.append(f"{block.where}: write '# not tested: <why>'")
    assert not problems, "\n".join(problems)


def test_file_blocks_are_the_files_they_name() -> None:
    """A block that shows a file of the repository shows all of it, as it is now."""
    problems = []
    for page in PAGES:
        for block in blocks(page):
            if block.file and (REPO / block.file).is_file():
                if (REPO / block.file).read_text(encoding="utf-8") != block.text:
                    problems.append(f"{block.where}: differs from {block.file}")
    assert not problems, "\n".join(problems)


def test_every_piece_of_a_config_passes_the_configs_checks(tmp_path: Path) -> None:
    """Each yaml block, merged over a shipped config (its own ``_base_`` where it names one),
    loads: its keys exist and its values are accepted."""
    from trainrun.runner.config import load_config

    problems = []
    base = REPO / "configs" / "digits_single.yaml"
    for page in PAGES:
        for block in (b for b in blocks(page) if b.is_config):
            try:
                piece = yaml.safe_load(block.text)
            except yaml.YAMLError as error:
                problems.append(f"{block.where}: not YAML: {error}")
                continue
            if not isinstance(piece, dict):
                problems.append(f"{block.where}: not a mapping of config keys")
                continue
            config = tmp_path / f"block_{block.line}.yaml"
            config.write_text(yaml.safe_dump({"_base_": str(base), **piece}), encoding="utf-8")
            try:
                load_config(config, on_warning=lambda _: None)
            except ValueError as error:
                problems.append(f"{block.where}: {error}")
    assert not problems, "\n".join(problems)


def page_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHONPATH"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def page_directory(tmp_path: Path) -> Path:
    """A reader's checkout, as far as the docs' commands use it."""
    for name in ("configs", "tools", "examples"):
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "work_dirs"))
    return tmp_path


def run_block(block, cwd: Path, env: dict[str, str], index: int) -> None:
    if block.lang == "bash":
        command = ["bash", "-c", "set -euo pipefail\n" + block.text]
    else:
        script = cwd / f".block_{index}.py"
        script.write_text(block.text, encoding="utf-8")
        command = [sys.executable, str(script)]
    done = subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    if done.returncode != 0:
        pytest.fail(f"{block.where}: exit {done.returncode}\n--- block\n{block.text}"
                    f"--- stdout\n{done.stdout[-4000:]}--- stderr\n{done.stderr[-6000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("page", runnable_pages(),
                         ids=lambda p: str(p.relative_to(REPO)).replace("/", "."))
def test_the_page_runs(page: Path, tmp_path: Path) -> None:
    cwd, env = page_directory(tmp_path), page_env()
    for index, block in enumerate(blocks(page)):
        if block.file:
            target = cwd / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
        elif block.runs:
            run_block(block, cwd, env, index)
