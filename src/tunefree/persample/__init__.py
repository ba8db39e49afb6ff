"""One backward pass → clipped per-sample gradient sums. Releases nothing: the engine (hooks, per-sample
norms, clip weights, book-keeping), the step accumulator, where each call carries its examples (layouts),
and the checks of what a step trains on: the inputs' provenance, the model's state between steps and the
example-independence check."""
