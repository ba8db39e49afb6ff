"""The one public door for extending tunefree from your own code.

- **A layer rule** (per-sample gradients of a module's own parameters, in one backward pass): one
  function, registered for your module type::

      @tunefree.extend.register_rule(Scale, reads_parameters=False)
      def scale_grads(module, capture, grad_outputs):   # y = x ⊙ w + b on [batch, features]
          x, g = capture.args[0], grad_outputs[0]       # the call's input, its output gradient
          return {"weight": x * g, "bias": g}            # [batch, *parameter shape] each

  or a :class:`LayerRule` subclass (``@register_rule`` on the class) for lazy forms with ghost norms
  (:class:`PerSampleGrad`). The capability flags say what the rest of the library may rely on:
  ``reads_parameters`` (False: the gradients come from the inputs and output gradients alone, so FSDP2
  may hold the parameters sharded meanwhile) and ``takes_declared_dim`` (True: the layer's tensors carry
  the examples wherever the user's ``batch_dim`` says, as ``nn.Linear``'s; False: in dimension 0). Every
  registered rule must be exact: check it against a batch-size-1 autograd loop.
- **A module that mixes examples** (its output for one example depends on others, like BatchNorm):
  :func:`register_example_mixing` makes the engine refuse it, naming the replacement.
- **A clip function**: a frozen dataclass subclass of :class:`ClipFunction` with ``weigh`` and its
  ``normalising`` flag, registered by name (``@register_clip_function("name")``), usable as
  ``clipping=YourFunction(...)`` or ``clipping="name"``. ``weigh`` runs one example at a time
  (``torch.vmap``): it sees one example's norm, so no weight can depend on another example; a function
  that cannot run so (control flow on a value, ``.item()``) or breaks ``wᵢ·‖gᵢ‖ ≤ R`` on a grid of norms is
  refused at ``make_private``.
- **A grouping** of parameters into clip groups: ``@register_grouping("name")`` on ``layout(model)``.
- **A step component** (:class:`StepComponent`): a part of the private step beyond the gradient release,
  run after the noisy gradient is in ``.grad`` (``before_update``) and after the optimizer's update
  (``after_update``). It sees a :class:`StepContext`: the released gradient and the weights, and the
  wrapped optimizer's learning rate and trial update (:class:`UpdateControl`); q·N and the thresholds
  the step clipped with (public); the batch's per-sample norms and the closure's per-sample losses
  (private). Every value it computes from private data leaves only through ``step.release(sums,
  sensitivity, noise_multiplier)``: Gaussian noise, and the release recorded in the ledger (in the step's
  Poisson-sampled event) before the value is returned, so ``engine.epsilon()`` accounts for it. Its
  releases are declared ahead by a :class:`Share` (what each step releases, as a function of the step's
  noise, and its own noise if the plan is to solve it), so that the run's noise is calibrated for the
  ε of everything released. HyFreeDP's learning rate (``components/hyfreedp.py``) is built on these
  points alone. Step components are not pluggable into ``make_private`` yet.
"""

from __future__ import annotations

from torch import nn

from .clipping.functions import ClipFunction, register_clip_function
from .clipping.groups import register_grouping
from .persample.units import SAMPLE_MIXING
from .privacy.plan import Share
from .rules import register_rule
from .rules.base import Capture, LayerRule, Materialized, PerSampleGrad
from .step.component import StepComponent, StepContext, StepReport, UpdateControl

__all__ = ["Capture", "ClipFunction", "LayerRule", "Materialized", "PerSampleGrad", "Share", "StepComponent",
           "StepContext", "StepReport", "UpdateControl", "register_clip_function", "register_example_mixing",
           "register_grouping", "register_rule"]


def register_example_mixing(module_type: type[nn.Module], replacement: str) -> None:
    """Refuse every ``module_type`` in a private model: its output for one example depends on the other
    examples of the batch, so no per-example gradient bounds an example's influence. ``replacement``
    is the fix the refusal suggests (e.g. ``"nn.GroupNorm"``)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_example_mixing takes an nn.Module subclass, got {module_type!r}")
    SAMPLE_MIXING[module_type] = replacement
