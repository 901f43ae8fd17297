"""The config reference's source: every key has a meaning, every shipped key a section."""

from __future__ import annotations

import glob
from pathlib import Path

from omegaconf import OmegaConf

from trainrun.runner.config import load_config
from trainrun.runner.reference import (
    docstring_args,
    flat_keys,
    sections,
    signature_entries,
    where_documented,
)
from trainrun.runner.schema import integer

REPO = Path(__file__).resolve().parents[2]


def test_every_key_says_what_it_means() -> None:
    undocumented = [f"{section.title}: {entry.key}" for section in sections()
                    for entry in section.entries if not entry.meaning.strip()]
    assert undocumented == []


def test_every_key_says_what_it_accepts() -> None:
    unsaid = [f"{section.title}: {entry.key}" for section in sections()
              for entry in section.entries
              if not entry.accepts.strip() or entry.accepts == "a valid value"]
    assert unsaid == []


def test_every_key_of_every_shipped_config_has_a_section() -> None:
    missing = []
    for path in sorted(glob.glob(str(REPO / "configs" / "*.yaml"))):
        cfg = OmegaConf.to_container(load_config(path, on_warning=lambda _: None))
        missing += [f"{Path(path).name}: {key}" for key in flat_keys(cfg)
                    if where_documented(key, cfg) is None]
    assert missing == []


def test_a_key_no_section_holds_is_found_nowhere() -> None:
    cfg = OmegaConf.to_container(load_config(REPO / "configs" / "digits_ddp.yaml",
                                             on_warning=lambda _: None))
    assert where_documented("optim.lr", cfg) == "cfg-optim"
    assert where_documented("data.val.val_fraction", cfg) == "cfg-data-digits"
    assert where_documented("strategy.bucket_cap_mb", cfg) == "cfg-strategy-ddp"
    assert where_documented("strategy.zero_stage", cfg) is None  # not a ddp option
    assert where_documented("no_such_key", cfg) is None


def test_a_class_is_documented_by_its_google_style_args() -> None:
    class Net:
        """A net.

        Args:
            width: how wide,
                over two lines.
            depth (int): how deep.

        Returns:
            nothing that is read here.
        """

        def __init__(self, width: int = 3, depth: int = 1, *args, **kwargs):
            pass

    assert docstring_args(Net) == {"width": "how wide, over two lines.", "depth": "how deep."}
    entries = {e.key: e for e in signature_entries("model", Net)}
    assert list(entries) == ["model.width", "model.depth"]
    assert entries["model.width"].default == "3"
    assert entries["model.width"].meaning == "how wide, over two lines."


def test_a_table_entry_without_its_meaning_shows_empty() -> None:
    from trainrun.runner.reference import table_entries

    (entry,) = table_entries("schedule", {"max_iters": (None, integer(1))})
    assert entry.meaning == "" and entry.accepts == "an int >= 1" and entry.default == "null"
