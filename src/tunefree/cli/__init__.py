"""The ``tunefree`` command line: an application over the library's public API.

Nothing in the library imports from this package.
"""

from .main import main

__all__ = ["main"]
