"""Writes the config reference from the config's own tables each time the site is built.

``trainrun.runner.reference`` lists every section and key with its default, what it accepts
and its meaning; this turns them into Markdown under ``docs/_generated/`` (not committed),
which ``config-reference.md`` includes, with an index of every key of the shipped configs'
resolved ``config.yaml``.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
OUT = DOCS / "_generated"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"``{text}``" if "`" in text else f"`{text}`"


def plain(text: str) -> str:
    """Text outside code, shown as written: ``<split>`` not taken for HTML, ``*`` not for
    emphasis."""
    return text.replace("<", "\\<").replace("*", "\\*")


def section_markdown(section: Any) -> list[str]:
    lines = [f"({section.anchor})=", f"### {plain(section.title)}", "", section.about, ""]
    if not section.entries:
        return lines
    lines += ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for entry in section.entries:
        lines.append(f"| {cell(code(entry.key))} | {cell(code(entry.default))} | "
                     f"{cell(plain(entry.accepts))} | {cell(plain(entry.meaning))} |")
    return [*lines, ""]


def reference_markdown() -> str:
    from trainrun.runner.reference import sections

    lines: list[str] = []
    for section in sections():
        lines += section_markdown(section)
    return "\n".join(lines)


def shipped_keys_markdown() -> str:
    """Every key of the shipped configs' resolved config, with where it is documented."""
    from omegaconf import OmegaConf

    from trainrun.runner.config import load_config
    from trainrun.runner.reference import flat_keys, sections, where_documented

    titles = {section.anchor: section.title for section in sections()}
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(glob.glob(str(DOCS.parent / "configs" / "*.yaml"))):
        cfg = OmegaConf.to_container(load_config(path, on_warning=lambda _: None))
        for key in flat_keys(cfg):
            where = where_documented(key, cfg)
            if where is None:
                raise ValueError(f"{Path(path).name}: {key} is in no section of the reference")
            found.setdefault(key, (where, []))[1].append(Path(path).stem)
    lines = ["| key | documented in | in |", "|---|---|---|"]
    for key in sorted(found):
        where, configs = found[key]
        shown = ", ".join(configs) if len(configs) < 4 else f"{len(configs)} configs"
        lines.append(f"| {cell(code(key))} | [{cell(plain(titles[where]))}](#{where}) | "
                     f"{shown} |")
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def generate(_app: Any = None) -> None:
    OUT.mkdir(exist_ok=True)
    write_if_changed(OUT / "config-sections.md", reference_markdown())
    write_if_changed(OUT / "config-keys.md", shipped_keys_markdown())


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
