"""Private data → released numbers, and what they cost: the noise source, the mechanisms, the planned run,
the ledger of releases, accounting and calibration."""
