"""A training step leaves the model a pure function of its weights and inputs, whatever holds its state.

State a model carries from one batch to the next — a running mean in a tensor defined on the class, a
helper object on the model, a list of prototypes, a ``collections.deque`` of recent features, a module-level
global, a value a hook keeps — carries the examples of one batch into every later release and into the
published model, with no noise. :mod:`.state` compares the tensors and numbers it knows where they live;
this guard watches what the model *does*: on each checked step (the run's independence schedule), a probe
pass (``guards/probe.py``: forward with gradients and one backward from a fixed loss, fixed seed, the engine
not capturing, nothing released) runs on a few of the step's first rows at the start of its first training
forward pass, and again, on the same rows at the same weights, before the step's release. Every unit's
activations and gradients and the model's outputs must agree bit for bit; else the model's function
changed during the step and nothing is released.

The probe rows are the first ``PROBE_ROWS`` examples of the inputs the Poisson loader handed out (the
other inputs as they are); with the loop's own loader, whose inputs carry no provenance, the whole batch.
What it cannot see (docs/refusals.md): state that changes nothing the probe rows compute (a state used only
once some condition holds, e.g. a full deque: a later check sees it), an update that the probe pass itself
redoes identically (a running maximum that the probe rows already reach), and state written by the loop
before the model is called.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PrivacyError
from . import probe
from .base import Guard, ModelCall
from .probe import Fingerprint, Tape

PROBE_ROWS = 2
_SEED = 0x5EED


class Purity(Guard):
    """Refuses a step during whose forward and backward passes the model's function changed.

    Args:
        model: the module the engine hooks.
        engine: the per-sample engine (its trainable units, its declared example dimension and
            ``no_capture()``).
        schedule: the step schedule: ``checking`` says whether the step under way is checked, ``consumed``
            which logical step it is.
        after_probes: called after each probe pass, with where it is (the state guard's quick check: a
            probe pass that writes the model's tensors or numbers is refused there).
    """

    def __init__(self, model, engine, schedule, after_probes=None):
        self.model, self.engine, self.schedule = model, engine, schedule
        self.after_probes = after_probes
        self._step: int | None = None  # the logical step whose first forward was probed
        self._inputs: tuple[tuple, dict, int] | None = None
        self._before: Tape | None = None
        self._regions: tuple = ()
        self._alerts: list[str] = []  # kernels with no deterministic implementation the probe passes ran

    def before_forward(self, call: ModelCall) -> None:
        step = self.schedule.consumed
        if not self.schedule.checking or self._step == step:
            return
        inputs = _probe_rows(call, self.engine.declared.root)
        if inputs[2] == 0:
            return  # an empty batch: nothing to run (a later forward of the step may have examples)
        self._step, self._inputs = step, inputs
        self._regions = probe.autocast_regions()  # the forward's precision, replayed after the backward
        self._before = self._pass(after_probe=False)  # its writes are the step's: seen before the release

    def before_release(self, step: int) -> None:
        if self._before is None or self._step != self.schedule.consumed:
            self._before = self._inputs = None
            return
        before, self._before = self._before, None
        after = self._pass(like=before)
        self._inputs = None
        where = _first_difference(before, after)
        if where is not None:
            raise PrivacyError(
                f"the model's function changed during the step: on the same inputs at the same weights, "
                f"{where} differs before the step's first forward pass and after its backward passes. The "
                "model keeps state from one batch for the next (a running mean or a cache updated in "
                "forward or in a hook, kept in a tensor defined on the class, a helper object, a list or "
                "deque of past activations, a global), which carries the examples of one batch into every "
                "later release and into the published model with no noise; nothing of this step is "
                "released. Keep no value computed from the data in the model or on objects it uses "
                "(compute running statistics from public data, or use layers without running state, e.g. "
                "GroupNorm/LayerNorm). If the state is a random generator of the model's own, draw from "
                "torch's global generator instead (tunefree fixes and restores it for the check)"
                + probe.nondeterminism(self._alerts))

    def _pass(self, like: Tape | None = None, after_probe: bool = True) -> Tape:
        args, kwargs, n = self._inputs
        engine = self.engine
        units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
        with probe.probing(engine, self._alerts), probe.in_regions(self._regions):
            tape = probe.record(self.model, units, args, kwargs, examples=n, root=engine.declared.root,
                                seed=_SEED, factors=[probe.example_factors(n)], like=like)
        if after_probe and self.after_probes is not None:
            self.after_probes("after the probe pass that checks the model's function")
        return tape


def _probe_rows(call: ModelCall, root: int) -> tuple[tuple, dict, int]:
    """The call's inputs cut to their first rows: each input computed from the loader's batch that holds
    the batch in dimension ``root``, detached and copied; the others as they are (a shared table, a
    mask). The whole batch where the inputs carry no provenance."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    n = call.examples
    if call.from_loader is None or n is None:
        kept = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        n = n if n is not None else next((x.shape[root] for x in leaves
                                          if isinstance(x, torch.Tensor) and x.dim() > root), 1)
        args, kwargs = tree_unflatten(kept, spec)
        return args, kwargs, n
    rows = min(n, PROBE_ROWS)
    kept = [x.detach().narrow(root, 0, rows).clone()
            if batched and isinstance(x, torch.Tensor) and x.dim() > root and x.shape[root] == n
            else (x.detach() if isinstance(x, torch.Tensor) else x)
            for x, batched in zip(leaves, call.from_loader)]
    args, kwargs = tree_unflatten(kept, spec)
    return args, kwargs, rows


def _first_difference(before: Tape, after: Tape) -> str | None:
    """Where ``after`` differs from ``before`` (``None``: nowhere), one host read."""
    flags = probe.Flags()
    if set(before.calls) != set(after.calls) or len(before.outputs) != len(after.outputs):
        return "which layers it calls"

    def compare(a: Fingerprint, b: Fingerprint, where: str) -> None:
        changed = probe.changed_rows(a, b)
        if changed is None:
            flags.certain = flags.certain or where
        else:
            flags.add(changed, where)

    for name, calls in before.calls.items():
        if len(calls) != len(after.calls[name]):
            return f"how often it calls module {name!r}"
        for old, new in zip(calls, after.calls[name]):
            for slot, a, b in zip(old.slots, old.values, new.values):
                compare(a, b, f"{slot.what} of module {name!r}")
    for k, (a, b) in enumerate(zip(before.outputs, after.outputs)):
        compare(a, b, f"the model's output {k}")
    for name, calls in before.calls.items():
        for old, new in zip(calls, after.calls[name]):
            for index, grads in old.grads.items():
                what = f"the gradient at {old.slots[index].what} of module {name!r}"
                if len(new.grads.get(index, [])) != len(grads):
                    flags.certain = flags.certain or what
                for a, b in zip(grads, new.grads.get(index, [])):
                    compare(a, b, what)
    return flags.first()
