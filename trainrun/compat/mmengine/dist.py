"""``mmengine.dist``: trainrun's own ``trainrun.dist``, which keeps MMEngine's names and
signatures (``init_dist``, ``get_dist_info``, ``all_reduce``, ``collect_results``, ...)."""

from trainrun.dist import *  # noqa: F403 - the whole public API, under MMEngine's path
from trainrun.dist import __all__  # noqa: F401
