"""``mmengine.runner._flexible_runner``: where MMEngine's own examples import
``FlexibleRunner`` from."""

from trainrun.compat.mmengine.runner import FlexibleRunner

__all__ = ["FlexibleRunner"]
