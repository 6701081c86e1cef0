"""The independent float64 oracle lives in the library (:mod:`attnzoo.oracle`, used by
``attnzoo check``); the tests import it from here as before."""

from attnzoo.oracle import oracle_attention, visible_table

__all__ = ["oracle_attention", "visible_table"]
