"""The ``tunefree`` command line: an application of the public API. It imports ``tunefree``,
``tunefree.extend`` and ``tunefree.privacy`` only (the releases of its preprocessing — partition
selection, quantiles, Gaussian releases — and the accounting helpers are public there), which
``tests/test_architecture.py`` checks.

Nothing in the library imports from this package.
"""

from .main import main

__all__ = ["main"]
