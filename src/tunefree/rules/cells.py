"""``nn.RNNCell``, ``nn.GRUCell`` and ``nn.LSTMCell``: one time step, usually called in a loop over time.

A cell is two linear maps, ``gᵢ = x W_ihᵀ + b_ih`` and ``g_h = h W_hhᵀ + b_hh``, followed by a pointwise
function of ``(gᵢ, g_h, state)`` (torch's documented cell equations). The gradients of the step's outputs with
respect to ``gᵢ`` and ``g_h`` are found for the whole batch at once (the pointwise part keeps examples
apart), so each weight's per-sample gradient is the factored form of a linear layer — ghost norm or
materialised — and each bias's is that gradient itself. A cell called T times in a forward is T uses of
its parameters, which the engine sums per example. The step is recomputed in the parameters' accumulation
dtype (float32 for 16-bit ones; under autocast the 16-bit inputs, states and output gradients are converted
to it), as ``nn.RNN``'s rule does.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dtypes import accumulation_dtype
from ..errors import PrivacyError
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import FactoredGrad


def lstm_step(gi: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
    """One LSTM step from its gate inputs ``gi`` (input part) and ``gh`` (hidden part): ``[h, c]``."""
    i, f, g, o = (gi + gh).chunk(4, 1)
    c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
    return [torch.sigmoid(o) * torch.tanh(c), c]


def gru_step(gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor):
    """One GRU step from its gate inputs ``gi`` and ``gh`` (torch's gate order r, z, n): ``[h]``."""
    i_r, i_z, i_n = gi.chunk(3, 1)
    h_r, h_z, h_n = gh.chunk(3, 1)
    reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    new = torch.tanh(i_n + reset * h_n)
    return [(1 - update) * new + update * h]


def rnn_step(module: nn.RNNCell | nn.RNN):
    """One step of an Elman cell with the module's nonlinearity, from ``gi`` and ``gh``: ``[h]``."""
    act = torch.tanh if module.nonlinearity == "tanh" else torch.relu
    return lambda gi, gh, h: [act(gi + gh)]


class CellRule(LayerRule):
    module_types = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)
    param_names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    takes_16_bit_grads = True  # converted to the recomputation's dtype

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, state = _inputs(module, capture)
        lstm = isinstance(module, nn.LSTMCell)
        h = state[0] if lstm else state
        dtype = accumulation_dtype(module.weight_ih.dtype)  # 16-bit inputs are converted, exactly
        state = tuple(_as(s, dtype) for s in state) if lstm else _as(state, dtype)
        with torch.enable_grad():
            gi = nn.functional.linear(_as(x, dtype), _as(module.weight_ih, dtype), _as(module.bias_ih, dtype))
            gh = nn.functional.linear(_as(h, dtype), _as(module.weight_hh, dtype), _as(module.bias_hh, dtype))
            gi.requires_grad_(True)
            gh.requires_grad_(True)
            step = lstm_step if lstm else \
                gru_step if isinstance(module, nn.GRUCell) else rnn_step(module)
            outputs = step(gi, gh, state)
            used = [(o, g.to(o.dtype)) for o, g in zip(outputs, grad_outputs) if g is not None]
            d_gi, d_gh = torch.autograd.grad([o for o, _ in used], [gi, gh], [g for _, g in used],
                                             allow_unused=True)
        d_gi = torch.zeros_like(gi) if d_gi is None else d_gi
        d_gh = torch.zeros_like(gh) if d_gh is None else d_gh
        factors = {"weight_ih": (x, d_gi), "weight_hh": (h, d_gh)}
        out: dict[str, PerSampleGrad] = {}
        for name in params:
            if name in factors:
                a, b = factors[name]
                out[name] = FactoredGrad(a[:, None, None, :], b[:, None, None, :], params[name].shape)
            else:
                out[name] = Materialized(d_gi if name == "bias_ih" else d_gh)
        return out


def _as(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.detach().to(dtype)


def _inputs(module: nn.Module, capture: Capture):
    """The step's input and state (zeros when none was given), batched."""
    args = list(capture.args) + [capture.kwargs[k] for k in ("input", "hx") if k in capture.kwargs]
    x, hx = args[0], (args[1] if len(args) > 1 else None)
    if x.dim() != 2:
        raise PrivacyError(f"{type(module).__name__} got an unbatched input of shape {tuple(x.shape)}; "
                           "tunefree needs a batch of examples, [B, input_size]")
    if hx is None:
        zeros = x.new_zeros(x.shape[0], module.hidden_size)
        return x, (zeros, zeros) if isinstance(module, nn.LSTMCell) else zeros
    return x, hx
