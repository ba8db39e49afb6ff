"""The errors tunefree raises when training would break the privacy guarantee."""

from __future__ import annotations


class PrivacyError(RuntimeError):
    """Training would break the privacy guarantee; the message says how to fix it."""
