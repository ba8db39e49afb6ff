"""One backward pass → clipped per-sample gradient sums; releases nothing. The engine (its hooks'
lifecycle) and its parts, each a function of the pass state: units, capture, mixed precision, clip weights
and booking; the step accumulator; where each call carries its examples (layouts); and the refusals it
names with their fix (a model's own loss, parametrized layers, a call on part of the batch)."""
