"""Per-sample gradients of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``, exact, by one small backward per example.

The fused recurrent kernel mixes nothing across examples, so example ``b``'s gradient is the gradient of
the layer re-run on example ``b`` alone (its input, its initial state), pulled back from example ``b``'s
slice of the output gradients. This holds for every configuration torch offers without dropout: any
depth, either direction, either layout (``batch_first``), an initial state (given, learned or computed from
the batch), ``LSTM(proj_size=...)``, and ``PackedSequence`` inputs (sorted or not): example ``b``'s packed
sequence of length ``n_b`` runs alone as its first ``n_b`` steps, with the same outputs and final state.
The re-run calls ``module.forward`` directly, so no hook records it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten

from ..errors import ModelRefused, PrivacyError
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .layout import Axis, CallLayout, Dim, Packed, Structure

_MAX_LAYERS = 32


def _recurrent_param_names() -> tuple[str, ...]:
    names = []
    for layer in range(_MAX_LAYERS):
        for suffix in ("", "_reverse"):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"):
                names.append(f"{kind}_l{layer}{suffix}")
    return tuple(names)


def _bound(module: nn.Module, args: tuple, kwargs: dict) -> tuple[object, object]:
    """The call's ``input`` and ``hx``, however they were passed."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    return bound["input"], bound.get("hx")


class RecurrentRule(LayerRule):
    """Exact per-sample gradients of RNN (tanh, relu), GRU and LSTM: any depth, either direction, either
    layout, with or without an initial state, with or without a projection, padded or packed."""

    module_types = (nn.RNN, nn.GRU, nn.LSTM)
    param_names = _recurrent_param_names()

    def example_dim(self, module: nn.Module, declared: int) -> int | None:
        return None  # the sequence follows batch_first, the states keep the examples in dimension 1

    def layout(self, module: nn.Module, args: tuple, kwargs: dict, num_outputs: int,
               declared: int) -> CallLayout:
        x, _ = _bound(module, args, kwargs)
        sequence: Axis = Packed(x) if isinstance(x, PackedSequence) else Dim(0 if module.batch_first else 1)
        inputs: list[Axis | None] = []
        for name, value in (*zip(inspect.signature(module.forward).parameters, args), *kwargs.items()):
            leaves = tree_flatten(value)[0]
            if name == "input":
                rest = [Structure() if isinstance(t, torch.Tensor) else None for t in leaves[1:]]
                inputs.extend([sequence, *rest])
            else:
                inputs.extend(Dim(1) if isinstance(t, torch.Tensor) else None for t in leaves)
        return CallLayout(tuple(inputs), (sequence,) + (Dim(1),) * (num_outputs - 1))

    def check(self, module: nn.Module, name: str) -> None:
        if module.num_layers > _MAX_LAYERS:
            raise ModelRefused(f"recurrent layer '{name}' has {module.num_layers} layers; tunefree supports "
                               f"at most {_MAX_LAYERS}: stack single-layer modules instead")
        if module.dropout > 0 and module.num_layers > 1:
            raise ModelRefused(
                f"recurrent layer '{name}' has dropout={module.dropout} between its layers; its masks are "
                "drawn inside the fused kernel and cannot be replayed per example. Set dropout=0 and put "
                "nn.Dropout between single-layer recurrent modules instead")

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, hx = _bound(module, capture.args, capture.kwargs)
        examples = _examples(module, x)
        names = list(params)
        per_example: list[list[torch.Tensor]] = []
        with torch.enable_grad():
            for b, x_b in enumerate(examples):
                hx_b = None if hx is None else _state_slice(hx, b)
                outputs = _batch_first_outputs(module, module.forward(x_b, hx_b))
                used = [(out, g[b:b + 1, :out.shape[1]] if i == 0 else g[b:b + 1])
                        for i, (out, g) in enumerate(zip(outputs, grad_outputs)) if g is not None]
                grads = torch.autograd.grad([o for o, _ in used], [params[n] for n in names],
                                            [g.to(o.dtype) for o, g in used], allow_unused=True)
                per_example.append([torch.zeros_like(params[n]) if g is None else g
                                    for n, g in zip(names, grads)])
        return {n: Materialized(torch.stack([grads[i] for grads in per_example]))
                for i, n in enumerate(names)}


def _examples(module: nn.Module, x: object) -> list[torch.Tensor]:
    """Each example's input sequence alone, in the module's layout: a batch of one (a packed example
    becomes its first ``n_b`` steps, unpacked)."""
    time_major = not module.batch_first
    if isinstance(x, PackedSequence):
        padded, lengths = pad_packed_sequence(x, batch_first=True)
        rows = [padded[b:b + 1, :int(n)].detach() for b, n in enumerate(lengths)]
        return [r.transpose(0, 1) for r in rows] if time_major else rows
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise PrivacyError(f"{type(module).__name__} got an unbatched input (shape "
                           f"{tuple(getattr(x, 'shape', ()))}); tunefree needs a batch of examples: a 3-D "
                           "tensor or a PackedSequence")
    dim = 1 if time_major else 0
    return [x.narrow(dim, b, 1).detach() for b in range(x.shape[dim])]


def _state_slice(hx: torch.Tensor | tuple[torch.Tensor, ...], b: int):
    if isinstance(hx, tuple):
        return tuple(h.narrow(1, b, 1).detach() for h in hx)
    return hx.narrow(1, b, 1).detach()


def _batch_first_outputs(module: nn.Module, result) -> list[torch.Tensor]:
    """A one-example run's output sequence and final states, each batch-first: ``[1, …]``."""
    output, state = result
    states = state if isinstance(state, tuple) else (state,)
    output = output if module.batch_first else output.transpose(0, 1)
    return [output, *(s.transpose(0, 1) for s in states)]
