"""Per-sample gradients of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``, exact, by one small backward per example.

The fused recurrent kernel mixes nothing across examples, so example ``b``'s gradient is the gradient of
the layer re-run on example ``b`` alone (its input and its initial state), pulled back from example ``b``'s
slice of the output gradients. The re-run calls ``module.forward`` directly, so no hook records it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..errors import PrivacyError
from .base import Capture, LayerRule, Materialized, PerSampleGrad

_MAX_LAYERS = 32


def _recurrent_param_names() -> tuple[str, ...]:
    names = []
    for layer in range(_MAX_LAYERS):
        for suffix in ("", "_reverse"):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                names.append(f"{kind}_l{layer}{suffix}")
    return tuple(names)


class RecurrentRule(LayerRule):
    """Exact per-sample gradients of RNN (tanh, relu), GRU and LSTM, any depth, either direction, either
    layout, with or without an initial state."""

    module_types = (nn.RNN, nn.GRU, nn.LSTM)
    expands_shared_inputs = False  # the initial state is [layers, B, H]: examples in dimension 1
    param_names = _recurrent_param_names()

    def output_batch_dims(self, module: nn.Module, num_outputs: int) -> tuple[int, ...]:
        output_dim = 0 if module.batch_first else 1
        return (output_dim,) + (1,) * (num_outputs - 1)  # h_n (and c_n) keep the batch in dim 1

    def check(self, module: nn.Module, name: str) -> None:
        if module.num_layers > _MAX_LAYERS:
            raise ValueError(f"recurrent layer '{name}' has {module.num_layers} layers; tunefree supports "
                             f"at most {_MAX_LAYERS}")
        if module.dropout > 0 and module.num_layers > 1:
            raise PrivacyError(
                f"recurrent layer '{name}' has dropout={module.dropout} between its layers; its masks are "
                "drawn inside the fused kernel and cannot be replayed per example. Set dropout=0 and put "
                "nn.Dropout between single-layer recurrent modules instead")
        if getattr(module, "proj_size", 0) > 0:
            raise PrivacyError(f"recurrent layer '{name}' has proj_size > 0, which tunefree does not support "
                               "yet; use proj_size=0 (optionally followed by an nn.Linear)")

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        if capture.kwargs:
            raise PrivacyError("pass the input and hx of a recurrent layer positionally, not by keyword")
        x, *rest = capture.args
        hx = rest[0] if rest else None
        if isinstance(x, PackedSequence):
            raise PrivacyError("tunefree does not support PackedSequence inputs to recurrent layers yet; "
                               "pass a padded tensor (and mask the padded steps' loss) instead")
        if x.dim() != 3:
            raise PrivacyError("tunefree needs a batched (3-D) input to a recurrent layer")
        input_dim = 0 if module.batch_first else 1
        dims = self.output_batch_dims(module, len(grad_outputs))
        names = list(params)
        per_example: list[list[torch.Tensor]] = []
        with torch.enable_grad():
            for b in range(x.shape[input_dim]):
                x_b = x.narrow(input_dim, b, 1).detach()
                hx_b = None if hx is None else _state_slice(hx, b)
                outputs = _flat_outputs(module.forward(x_b, hx_b))
                used = [(out, g.narrow(dim, b, 1)) for out, g, dim in zip(outputs, grad_outputs, dims)
                        if g is not None]
                grads = torch.autograd.grad([o for o, _ in used], [params[n] for n in names],
                                            [g.to(o.dtype) for o, g in used], allow_unused=True)
                per_example.append([torch.zeros_like(params[n]) if g is None else g
                                    for n, g in zip(names, grads)])
        return {n: Materialized(torch.stack([grads[i] for grads in per_example]))
                for i, n in enumerate(names)}


def _state_slice(hx: torch.Tensor | tuple[torch.Tensor, ...], b: int):
    if isinstance(hx, tuple):
        return tuple(h.narrow(1, b, 1).detach() for h in hx)
    return hx.narrow(1, b, 1).detach()


def _flat_outputs(result) -> list[torch.Tensor]:
    output, state = result
    return [output, *(state if isinstance(state, tuple) else (state,))]
