"""One private step, in order: the component protocol and the private optimizer."""
