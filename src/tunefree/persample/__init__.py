"""One backward pass → clipped per-sample gradient sums. Releases nothing: the engine (hooks, per-sample
norms, clip weights, book-keeping), the step accumulator and the example-independence check."""
