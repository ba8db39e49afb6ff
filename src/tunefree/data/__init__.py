"""Poisson sampling and data set loading."""
