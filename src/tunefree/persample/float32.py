"""IEEE float32 for the engine's own products (docs/gpu.md, *TF32*).

The engine measures each example's gradient norm by one product (a ghost norm's Gram matrices, or the
per-sample gradients) and forms the clipped sum by another (e.g. cuDNN's weight gradient of the
re-weighted output gradient). The clip bound holds for the released sum only if both are the same
numbers up to float32 rounding. TF32 (cuDNN convolutions use it by default on Ampere and later;
``torch.backends.cuda.matmul.fp32_precision = "tf32"`` or ``set_float32_matmul_precision("high")``
turn it on for matrix products) or oneDNN's bf16 mode rounds each product's operands to 10 (or 7) bits
of mantissa, and its error is not bounded by the measured norm: where an example's terms cancel, the
rounding of the sum can be as large as the terms themselves. So the engine computes with these modes
off, and restores the user's settings afterwards: the model's own forward and backward pass keep them.
"""

from __future__ import annotations

import torch

# (backend, operation) pairs of torch's float32 precision settings, per device type
_SETTINGS = {
    "cuda": (("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn")),
    "cpu": (("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn")),
}
ALL_DEVICES = tuple(_SETTINGS)
_get, _set = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter


class ieee_float32:  # noqa: N801 - used as a function: ``with ieee_float32("cuda"):``
    """Float32 matrix products, convolutions and recurrent layers on ``device_types`` (``"cuda"``,
    ``"cpu"``) computed in IEEE float32 (no TF32, no bf16) inside the block; every setting it changed
    is set back on the way out, also when the block raises. (A class, not a generator: it is entered
    once per layer in the backward pass.)"""

    __slots__ = ("_settings", "_changed")

    def __init__(self, *device_types: str):
        self._settings = [key for device_type in device_types for key in _SETTINGS.get(device_type, ())]

    def __enter__(self) -> None:
        self._changed = [(backend, op, value) for backend, op in self._settings
                         if (value := _get(backend, op)) != "ieee"]
        for backend, op, _ in self._changed:
            _set(backend, op, "ieee")

    def __exit__(self, *exc) -> bool:
        for backend, op, value in self._changed:
            _set(backend, op, value)
        return False
