"""What every driver of a protection backend shares: the statistics' group/tensor layout."""

from .layout import Layout, flatten, layout_of, unflatten

__all__ = ["Layout", "flatten", "layout_of", "unflatten"]
