"""Mechanisms, the ledger of releases, accounting and calibration."""
