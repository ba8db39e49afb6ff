"""Integrations with other training frameworks. Each module imports its framework itself, so that
``import tunefree`` never needs it: ``tunefree.integrations.hf_trainer`` (Hugging Face ``Trainer``)."""
