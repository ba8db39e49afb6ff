"""Optional parts of the private step: adaptive thresholds, lr="auto" (DoG), HyFreeDP."""
