"""The errors tunefree raises when training would break the privacy guarantee.

Every refusal is a :class:`PrivacyError` whose message says what is wrong and how to fix it. Its two
kinds are also ``ValueError``s, so that code catching the ``ValueError`` these refusals used to be keeps
working: :class:`ModelRefused` (the model, as built, would leak or cannot be clipped per example) and
:class:`SettingsRefused` (settings that contradict each other or the guarantee)."""

from __future__ import annotations


class PrivacyError(RuntimeError):
    """Training would break the privacy guarantee; the message says how to fix it."""


class ModelRefused(PrivacyError, ValueError):
    """A layer or configuration of the model mixes examples, or cannot be clipped per example."""


class SettingsRefused(PrivacyError, ValueError):
    """Settings that contradict each other, or under which the stated guarantee would not hold."""
