"""Poisson sampling: the sampler and loader of a private run, and its logical-step schedule."""
