"""Default models for the command line: a small CNN for images, an MLP for tables.

Tanh activations (bounded, which suits private training) and GroupNorm where normalisation helps;
never BatchNorm, which mixes examples.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODELS = ("auto", "cnn", "mlp", "linear")


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two convolution blocks then a classifier; for 8×8 up to 32×32 inputs."""
    channels, height, width = input_shape
    if min(height, width) >= 24:  # MNIST / CIFAR sizes: stride-2 convolutions as Papernot et al.
        features = nn.Sequential(
            nn.Conv2d(channels, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1), nn.Flatten())
    else:
        features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.Tanh(),
            nn.AvgPool2d(2), nn.Flatten())
    width_out = _flat_size(features, input_shape)
    return nn.Sequential(features, nn.Linear(width_out, 32), nn.Tanh(), nn.Linear(32, num_classes))


DEFAULT_HIDDEN = (128,)


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = DEFAULT_HIDDEN
        ) -> nn.Module:
    """Flatten, then a Linear layer and Tanh for each width in ``hidden``, then the classifier."""
    widths = [math.prod(input_shape), *hidden]
    layers: list[nn.Module] = [nn.Flatten()]
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], num_classes))


def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    features = 1
    for size in input_shape:
        features *= size
    return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))


def _flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).shape[1]


def resolve(name: str, kind: str, input_shape: tuple[int, ...], hidden: tuple[int, ...] | None = None) -> str:
    """The concrete model ``name`` stands for (``auto``: a CNN for images of at least 24 pixels a side,
    an MLP for tables and smaller images — on the 8×8 digits the MLP is both faster and more accurate
    privately: 0.92 against 0.86–0.91 for the CNN at ε = 3), after refusing what cannot be built; needs
    only public facts (the data's kind and image size), so it can refuse before any release."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")
    if name == "auto":
        large_image = kind == "image" and min(input_shape[1:]) >= 24
        name = "cnn" if large_image else "mlp"
    if hidden is not None and name != "mlp":
        raise ValueError(f"--hidden sizes the MLP, and this run's model is the {name}: drop --hidden or "
                         "pass --model mlp")
    if name == "cnn" and kind != "image":
        raise ValueError("--model cnn needs image data; use --model mlp for tables")
    return name


def build(name: str, kind: str, input_shape: tuple[int, ...], num_classes: int,
          hidden: tuple[int, ...] | None = None) -> nn.Module:
    """The model ``name`` (see :func:`resolve`). ``hidden``: the MLP's hidden widths (default one layer
    of 128); refused for the other models."""
    name = resolve(name, kind, input_shape, hidden)
    if name == "cnn":
        return cnn(input_shape, num_classes)
    if name == "mlp":
        return mlp(input_shape, num_classes, DEFAULT_HIDDEN if hidden is None else tuple(hidden))
    return linear(input_shape, num_classes)
