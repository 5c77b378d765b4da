"""make_index: the prefix index :attr:`IndexConfig.backend` names, typed as the interface
both implementations provide (router.core.index_api.PrefixIndexAPI)."""

from __future__ import annotations

from router.core.index import PrefixIndex
from router.core.index_api import IndexConfig, PrefixIndexAPI

__all__ = ["make_index"]


def make_index(config: IndexConfig | None = None) -> PrefixIndexAPI:
    """The index ``config.backend`` names (numba is imported only when asked for)."""
    config = config or IndexConfig()
    if config.backend == "numba":
        from router.core.index_nb import NumbaPrefixIndex

        return NumbaPrefixIndex(config)
    return PrefixIndex(config)
