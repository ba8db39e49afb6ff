"""Per-sample gradients of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``, exact, batched over the examples.

Every weight of a recurrent layer enters through a linear map of a step's input or state, so its per-sample
gradient is a sum over the time steps of outer products — the factored form of a linear layer:

    weight_ih:  Σₜ δgᵢ,ₜ xₜᵀ      (xₜ the layer's input at step t, δgᵢ,ₜ the gradient of its gate inputs)
    weight_hh:  Σₜ δgₕ,ₜ hₜ₋₁ᵀ    (hₜ₋₁ the state the step read, δgₕ,ₜ the gradient of its hidden gates)
    weight_hr:  Σₜ δhₜ mₜᵀ        (LSTM(proj_size): mₜ the unprojected output, δhₜ the projected one's)

and each bias's is its gate gradient summed over the steps. The rule recomputes the layer's forward pass
for the whole batch, step by step (torch's documented cell equations, ``cells.py``), and one backward pass
through it from the layer's output gradients gives every δ at once: a fixed number of batched calls per
layer and time step, whatever the batch size. The gradients asked for are taken at zero tensors added to
the hidden gates and projected outputs of every step (``x + 0`` is ``x``), so that one tensor per layer and
direction holds them for all steps. Norms by ghost norm or materialised, whichever is cheaper
(``FactoredGrad``).

Every configuration torch offers without dropout: any depth, either direction, either layout
(``batch_first``), an initial state (given, learned or computed from the batch), ``LSTM(proj_size=...)``,
and ``PackedSequence`` inputs (sorted or not): a packed example of length ``n_b`` runs its first ``n_b``
steps (in the reverse direction, from step ``n_b − 1`` down) and keeps its state after them, as the packed
kernel does. The recomputation runs in the parameters' accumulation dtype (float32 for 16-bit ones), with
16-bit output gradients converted there.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten

from ..dtypes import accumulation_dtype
from ..errors import ModelRefused, PrivacyError
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .cells import gru_step, lstm_step, rnn_step
from .factored import FactoredGrad
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

    takes_16_bit_grads = True  # converted to the recomputation's dtype

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, hx = _bound(module, capture.args, capture.kwargs)
        dtype = accumulation_dtype(module.weight_ih_l0.dtype)
        run = _Recomputed(module, *_padded(module, x), hx, dtype)
        asked = [(piece, name, t) for piece in run.pieces for name, t in piece.asked().items()]
        with torch.enable_grad():  # one backward pass through the recomputation: every δ of the layer
            used = [(out, g.to(dtype)) for out, g in zip(run.outputs(), grad_outputs) if g is not None]
            found = torch.autograd.grad([o for o, _ in used], [t for _, _, t in asked], [g for _, g in used],
                                        allow_unused=True)
        grads: dict[_Direction, dict[str, torch.Tensor]] = {piece: {} for piece in run.pieces}
        for (piece, name, t), g in zip(asked, found):
            grads[piece][name] = torch.zeros_like(t) if g is None else g
        out: dict[str, PerSampleGrad] = {}
        for piece in run.pieces:
            out.update(piece.forms(grads[piece], params))
        return out


class _Direction:
    """One layer and direction of the recomputed forward pass: what its per-sample gradients are made of.

    ``x``: its input sequence ``[B, T, F]``; ``gi``: its gate inputs from ``x``, all steps; ``h_prev``: the
    state each step read ``[B, T, P]``; ``gh_zero`` (GRU) and ``h_zero`` (projection): the zeros added to
    the hidden gates and projected outputs of every step, whose gradients are δgₕ and δh; ``m``: the
    unprojected outputs."""

    def __init__(self, suffix: str, x: torch.Tensor, gi: torch.Tensor):
        self.suffix, self.x, self.gi = suffix, x, gi
        self.h_prev: torch.Tensor | None = None
        self.gh_zero: torch.Tensor | None = None
        self.h_zero: torch.Tensor | None = None
        self.m: torch.Tensor | None = None

    def asked(self) -> dict[str, torch.Tensor]:
        """The tensors whose gradients make this direction's per-sample gradients, by name."""
        asked = {"gi": self.gi, "gh": self.gh_zero, "h": self.h_zero}
        return {name: t for name, t in asked.items() if t is not None}

    def forms(self, grads: dict[str, torch.Tensor], params: dict[str, nn.Parameter]
              ) -> dict[str, PerSampleGrad]:
        """Each of this direction's parameters in ``params``: its per-sample gradient."""
        d_gi = grads["gi"]
        d_gh = grads.get("gh", d_gi)  # RNN and LSTM add the two gate inputs: the same gradient
        factors = {"weight_ih": (self.x, d_gi), "weight_hh": (self.h_prev, d_gh)}
        if self.m is not None:
            factors["weight_hr"] = (self.m, grads["h"])
        out: dict[str, PerSampleGrad] = {}
        for kind, (a, b) in factors.items():
            name = kind + self.suffix
            if name in params:
                out[name] = FactoredGrad(a.detach()[:, None], b[:, None], params[name].shape)
        for kind, b in (("bias_ih", d_gi), ("bias_hh", d_gh)):
            if kind + self.suffix in params:
                out[kind + self.suffix] = Materialized(b.sum(1))
        return out


class _Recomputed:
    """The layer's forward pass recomputed for the whole batch, batch-first, step by step, in ``dtype``:
    ``output`` ``[B, T, D·P]``, the final states ``final_h`` (and ``final_c``), one per layer and direction
    in torch's order, each ``[B, P]``; ``pieces``: the layers and directions."""

    def __init__(self, module: nn.Module, seq: torch.Tensor, lengths: torch.Tensor | None, hx,
                 dtype: torch.dtype):
        self.lstm = isinstance(module, nn.LSTM)
        batch, steps = seq.shape[:2]
        directions = 2 if module.bidirectional else 1
        hidden = module.hidden_size
        out_size = module.proj_size if self.lstm and module.proj_size > 0 else hidden
        states = module.num_layers * directions
        if hx is None:
            zeros = seq.new_zeros(states, batch, out_size, dtype=dtype)
            h0, c0 = zeros, seq.new_zeros(states, batch, hidden, dtype=dtype)
        else:
            h0, c0 = (hx if self.lstm else (hx, None))
        # step t of example b runs iff t < its length (packed sequences)
        active = None if lengths is None else \
            (torch.arange(steps)[:, None] < lengths[None, :]).to(seq.device)[..., None]
        self.pieces: list[_Direction] = []
        self.final_h: list[torch.Tensor] = []
        self.final_c: list[torch.Tensor] = []
        layer_input = seq.detach().to(dtype)
        with torch.enable_grad():
            for layer in range(module.num_layers):
                outputs = []
                for direction in range(directions):
                    index = layer * directions + direction
                    suffix = f"_l{layer}" + ("_reverse" if direction else "")
                    state = (h0[index], None if c0 is None else c0[index])
                    outputs.append(self._direction(module, suffix, layer_input, state, active,
                                                   reverse=direction == 1, dtype=dtype))
                layer_input = outputs[0] if directions == 1 else torch.cat(outputs, 2)
        self.output = layer_input

    def outputs(self) -> list[torch.Tensor]:
        """The layer's outputs as the engine hands their gradients: the sequence, then ``h_n`` (and ``c_n``)
        batch-first ``[B, layers·directions, …]``."""
        states = [self.final_h] + ([self.final_c] if self.lstm else [])
        return [self.output, *(torch.stack(s, 1) for s in states)]

    def _direction(self, module: nn.Module, suffix: str, x: torch.Tensor, state, active,
                   reverse: bool, dtype: torch.dtype) -> torch.Tensor:
        def weight(kind: str) -> torch.Tensor | None:
            p = getattr(module, kind + suffix, None)
            return None if p is None else p.detach().to(dtype)

        gi = F.linear(x, weight("weight_ih"), weight("bias_ih"))
        if not gi.requires_grad:  # the first layer: the gradient is asked of its gate inputs
            gi.requires_grad_(True)
        piece = _Direction(suffix, x, gi)
        w_hh, b_hh, w_hr = weight("weight_hh"), weight("bias_hh"), weight("weight_hr")
        batch, steps = x.shape[:2]
        if isinstance(module, nn.GRU):
            piece.gh_zero = gi.new_zeros(batch, steps, w_hh.shape[0], requires_grad=True)
        if w_hr is not None:
            piece.h_zero = gi.new_zeros(batch, steps, w_hr.shape[0], requires_grad=True)
        step = lstm_step if self.lstm else gru_step if isinstance(module, nn.GRU) else rnn_step(module)
        h = state[0].detach().to(dtype).requires_grad_(True)  # a leaf: every step joins the graph
        c = None if state[1] is None else state[1].detach().to(dtype)
        h_prev, outputs, unprojected = [None] * steps, [None] * steps, [None] * steps
        for t in (reversed(range(steps)) if reverse else range(steps)):
            h_prev[t] = h
            gh = F.linear(h, w_hh, b_hh)
            if piece.gh_zero is not None:
                gh = gh + piece.gh_zero[:, t]
            new = step(gi[:, t], gh, (h, c) if self.lstm else h)
            h_new = new[0]
            if w_hr is not None:
                unprojected[t] = h_new
                h_new = F.linear(h_new, w_hr) + piece.h_zero[:, t]
            if active is None:
                h, c = h_new, (new[1] if self.lstm else None)
            else:  # an example past its length keeps its state
                h = torch.where(active[t], h_new, h)
                c = torch.where(active[t], new[1], c) if self.lstm else None
            outputs[t] = h_new if active is None else torch.where(active[t], h_new, 0.0)
        piece.h_prev = torch.stack(h_prev, 1).detach()
        if w_hr is not None:
            piece.m = torch.stack(unprojected, 1).detach()
        self.pieces.append(piece)
        self.final_h.append(h)
        if self.lstm:
            self.final_c.append(c)
        return torch.stack(outputs, 1)


def _padded(module: nn.Module, x: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call's input sequence batch-first ``[B, T, F]`` in the batch's own order, and for a packed one
    each example's length (CPU)."""
    if isinstance(x, PackedSequence):
        return pad_packed_sequence(x, batch_first=True)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise PrivacyError(f"{type(module).__name__} got an unbatched input (shape "
                           f"{tuple(getattr(x, 'shape', ()))}); tunefree needs a batch of examples: a 3-D "
                           "tensor or a PackedSequence")
    return (x if module.batch_first else x.transpose(0, 1)), None
