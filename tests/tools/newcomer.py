"""Classes of the kind a newcomer brings (issue 22), named by import path in the tests
(``data.train.type=tests.tools.newcomer.FolderDigits``): a data set with a required
argument, and a model and a data set that take any keyword (``**extra``); and a project
directory with its own model module, on no path (`user_project`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainrun.examples.digits import DigitsDataset, DigitsMLP


class FolderDigits(DigitsDataset):
    """The digits, as if read from ``root``: an argument without a default."""

    def __init__(self, root: str, split: str = "train", val_fraction: float = 0.2,
                 split_seed: int = 0, test_fraction: float = 0.0):
        super().__init__(split, val_fraction, split_seed, test_fraction)
        self.root = root


class OpenDigitsMLP(DigitsMLP):
    """The digits model, keeping any other keyword it is given in ``extra``."""

    def __init__(self, hidden: int = 64, **extra: Any):
        super().__init__(hidden=hidden)
        self.extra = extra


class OpenDigits(DigitsDataset):
    """The digits, keeping any other keyword they are given in ``extra``."""

    def __init__(self, split: str = "train", **extra: Any):
        super().__init__(split=split)
        self.extra = extra


USER_MODEL = '''from trainrun.examples.digits import DigitsMLP


class Net(DigitsMLP):
    """A researcher's own model, in my_model.py beside their config."""
'''


def user_project(root: Path) -> Path:
    """A new directory ``root`` holding ``my_model.py`` (``model.type: my_model.Net``)."""
    root.mkdir()
    (root / "my_model.py").write_text(USER_MODEL)
    return root
