"""The ``tunefree`` command line: an application of the library. It uses the public API and, where that
offers nothing yet, a few internal modules (the option lists, the σ floor, HyFreeDP's rule for its
report, and the mechanisms of its own preprocessing releases: partition selection, quantiles, the
standardisation of table columns).

Nothing in the library imports from this package.
"""

from .main import main

__all__ = ["main"]
