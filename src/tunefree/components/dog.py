"""A learning rate read off the released gradients alone: DoG ("distance over gradients", Ivgi, Hinder &
Carmon 2023), optionally made aware of the privacy noise.

DoG sets the step size of SGD to ``η_t = r_t / √(Σ_{i≤t} ‖g_i‖²)`` with ``r_t = max(r_ε, max_{i≤t} ‖x_i −
x_0‖)``: the distance travelled over the accumulated gradient energy. Here ``g_i`` is the privatised mean
gradient the optimizer releases and ``x_i`` are the weights, which depend on the data only through earlier
releases, so the rule is post-processing: it costs no privacy, no forward and no ledger event.

In DP-SGD the released gradient is ``ḡ + n`` with Gaussian noise whose variance per coordinate is known to
the release (``σ_k²C_k²/(q·N)²`` in clip group k). Its energy ``E‖n‖² = Σ_k d_k σ_k²C_k²/(q·N)²`` usually
dwarfs ``‖ḡ‖²``, and the distance travelled is then a random walk, so DoG's step stays where it started.
``noise_aware=True`` subtracts the known noise energy from the accumulated gradient energy (counting the
remainder only where it exceeds two standard deviations of the noise energy's own fluctuation) and
from the squared distance travelled the noise walk ``‖Σ η_i n_i‖²``: its expectation ``Σ η_i² E‖n‖²``
and one standard deviation of its fluctuation, so that DoG's running maximum of the distance does not
climb on the walk's upward swings (measured: without this margin the step overshoots on short, noisy
runs; benchmarks/RESULTS.md §5c). All of these are public (σ, the thresholds, q·N and the shapes), so
this is still post-processing.

DoG reads the distance travelled as the distance to go, which holds while the weights move by their
signal. When the privacy noise dominates a long run, the noise walk itself is what moves the weights, and
the larger the step, the further it carries them: a step that is right for a short run overshoots on a
long one (benchmarks/RESULTS.md §5c, §5e). So the step also keeps to a **noise budget**: over the whole
planned run the expected noise walk ``Σ_i η_i² E‖n_i‖²`` may reach at most ``(κ·(1 + ‖x_0‖))²``, spent
evenly over the steps that remain, i.e. ``η_t ≤ √((budget − walk so far) / (steps left × E‖n_t‖²))``.
With constant noise this is the constant ``η = κ(1 + ‖x_0‖)/√(T·E‖n‖²)``: the step falls as the run
grows longer or noisier. Both factors are public (the planned length, σ, the thresholds, q·N, the
initial weights), so the budget is post-processing too.

The walk a model tolerates also depends on its inputs' scale: where their root mean square is public
(``DoG.input_rms``), a larger one shrinks the budget (:func:`input_scale_factor`, benchmarks/RESULTS.md §5h);
one read off the private inputs would be a release.

As the DoG paper recommends, the component also keeps the polynomially averaged weights
``x̄_t = (1 − (γ+1)/(t+γ))·x̄_{t−1} + (γ+1)/(t+γ)·x_t`` (γ = 8), which average the noise out of the last
steps; :meth:`DistanceOverGradients.apply_average` writes them into the model (post-processing too).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import flag, positive
from ..privacy.mechanisms import GradientRelease
from ..step.component import StepComponent, StepContext

# The constants were chosen once on the validation splits of the four tasks of benchmarks/utility.py at
# ε ∈ {1, 3, 8} (benchmarks/RESULTS.md §5c).
INITIAL_DISTANCE = 0.1  # r_ε = this × (1 + ‖x_0‖); DoG's 1e-6 is too small to grow from in a short DP run
AVERAGING = 8.0  # γ of the polynomial iterate average
SIGNIFICANCE = 2.0  # the gradient energy counts once it exceeds this many deviations of the noise energy
WALK_MARGIN = 1.0  # the distance counts once it exceeds the noise walk by this many of its deviations
NOISE_BUDGET = 4.0  # κ: the planned run's noise walk may reach κ·(1 + ‖x_0‖) (RESULTS §5e)
INPUT_RMS_REFERENCE = 0.5  # ρ_ref: inputs with a public rms ρ above it get the budget × ρ_ref/ρ (§5h)


@dataclass(frozen=True)
class DoG:
    """``lr="auto"``: the step size of plain SGD from the released gradients alone (noise-aware DoG),
    bounded by a noise budget that keeps the planned run's noise walk within κ·(1 + ‖x₀‖)
    (``noise_budget`` κ; ``None`` turns it off). It releases nothing: no ε, no extra forward, no
    closure. ``initial_distance`` is DoG's first move relative to 1 + ‖x₀‖. Both constants were chosen
    on validation splits (benchmarks/RESULTS.md §5c, §5e). ``input_rms`` (§5h): the root mean square of the
    model's input coordinates where it is public (never measured on private data: that would be a
    release); above ``INPUT_RMS_REFERENCE`` it shrinks the budget in proportion. ``None``: unknown."""

    initial_distance: float = INITIAL_DISTANCE
    noise_budget: float | None = NOISE_BUDGET
    noise_aware: bool = True  # False: DoG on the noisy gradient as it is (a baseline, benchmarks/utility.py)
    input_rms: float | None = None

    def __post_init__(self) -> None:
        positive("DoG.initial_distance", self.initial_distance)
        if self.noise_budget is not None:
            positive("DoG.noise_budget", self.noise_budget)
        if self.input_rms is not None:
            positive("DoG.input_rms", self.input_rms)
        flag("DoG.noise_aware", self.noise_aware)

    def share(self) -> None:
        """No share of the budget: DoG is post-processing."""
        return None


class DistanceOverGradients(StepComponent):
    """Sets the learning rate of every parameter group of the wrapped optimizer (meant for SGD) by DoG.

    Args:
        release: the gradient mechanism, read for its per-group noise standard deviations (public).
        expected_batch_size: q·N, by which the released sums are divided.
        settings: the :class:`DoG` option (its constants, noise-awareness and the inputs' public rms).
        planned_steps: the planned length T of the run, over which the noise budget is spent (``None``:
            no budget).
    """

    state_key = "DistanceOverGradients"

    def __init__(self, release: GradientRelease, expected_batch_size: float, settings: DoG = DoG(), *,
                 planned_steps: int | None = None):
        if planned_steps is not None and not (isinstance(planned_steps, int) and planned_steps >= 1):
            raise ValueError(f"planned_steps must be a positive integer or None, got {planned_steps}")
        initial_distance, noise_budget = settings.initial_distance, settings.noise_budget
        self.release, self.expected_batch_size = release, expected_batch_size
        self.noise_aware, self.initial_distance = settings.noise_aware, initial_distance
        self.planned_steps = planned_steps
        self.noise_budget = None if planned_steps is None else noise_budget
        self.input_scale = input_scale_factor(settings.input_rms)
        self.walk_budget = math.inf  # (κ·(1 + ‖x_0‖))², set at the first step
        self.budget_lr = math.inf  # the noise budget's step bound, kept past the planned steps
        self.origin: list[torch.Tensor] | None = None
        self.distance = 0.0  # r_t
        self.gradient_energy = 0.0  # Σ ‖g_i‖², less the noise energy when noise-aware
        self.noise_energy_variance = 0.0  # Σ var(‖n_i‖²)
        # per parameter: Σ η_i² × its noise variance per coordinate, the noise walk's variance per coordinate
        self.walk_variances: list[float] = []
        self.lr = math.nan
        self.history: list[float] = []
        self.average: list[torch.Tensor] | None = None  # x̄_t
        self.params: list[torch.Tensor] | None = None  # the optimizer's parameters, seen at each step
        self.updates = 0

    def coordinate_variances(self, thresholds: dict[str, float]) -> list[tuple[int, float]]:
        """Per parameter: its size and the noise variance of each coordinate of the released mean gradient
        (public: σ, C, q·N)."""
        return [(p.numel(), (std / self.expected_batch_size) ** 2)
                for p, std in self.release.param_stds(thresholds)]

    def noise_walk(self, sizes: list[int]) -> tuple[float, float]:
        """Mean and standard deviation of ‖Σ η_i n_i‖², the squared noise walk of the steps so far (a sum
        of scaled χ²), i.e. the noise's share of ‖x_t − x_0‖²."""
        pairs = list(zip(sizes, self.walk_variances))
        return sum(d * w for d, w in pairs), math.sqrt(sum(2 * d * w * w for d, w in pairs))

    def before_update(self, step: StepContext) -> None:
        params = step.update.params
        with torch.no_grad():
            if self.origin is None:
                self.origin = [p.detach().clone() for p in params]
                self.distance = self.initial_distance * self._origin_scale()
            weights = [p.detach() for p in params]
            moved, energy = _squared_norms(torch._foreach_sub(weights, self.origin),
                                           [p.grad for p in params if p.grad is not None])
        variances = self.coordinate_variances(step.report.thresholds)
        if not self.walk_variances:
            self.walk_variances = [0.0] * len(variances)
        walk, walk_deviation = self.noise_walk([d for d, _ in variances])
        noise_energy = sum(d * v for d, v in variances)  # E‖n_t‖²
        if self.noise_aware:
            moved -= walk + WALK_MARGIN * walk_deviation
            energy -= noise_energy
            self.noise_energy_variance += sum(2 * d * v * v for d, v in variances)
        self.distance = max(self.distance, math.sqrt(max(moved, 0.0)))
        self.gradient_energy += energy
        floor = SIGNIFICANCE * math.sqrt(self.noise_energy_variance)
        self.lr = min(self.distance / math.sqrt(max(self.gradient_energy, floor, 1e-16)),
                      self._budget_lr(walk, noise_energy))
        self.walk_variances = [w + self.lr ** 2 * v for w, (_, v) in zip(self.walk_variances, variances)]
        self.history.append(self.lr)
        step.update.set_lr(self.lr)

    def _origin_scale(self) -> float:
        """1 + ‖x₀‖, the scale of DoG's first move and of the noise budget; sets the walk budget
        (κ(1 + ‖x₀‖) × the inputs' factor, :func:`input_scale_factor`)."""
        scale = 1 + math.sqrt(_squared_norms(self.origin)[0])
        if self.noise_budget is not None:
            self.walk_budget = (self.noise_budget * scale * self.input_scale) ** 2
        return scale

    def _budget_lr(self, walk: float, noise_energy: float) -> float:
        """The largest step that keeps the expected noise walk of the planned run within the budget, the
        budget left (less the walk ``walk`` so far) spent evenly over the steps left; past the planned
        steps, the last such bound."""
        if self.noise_budget is None or noise_energy <= 0:
            return math.inf
        steps_left = self.planned_steps - self.updates
        if steps_left >= 1:
            self.budget_lr = math.sqrt(max(self.walk_budget - walk, 0.0) / (steps_left * noise_energy))
        return self.budget_lr

    def after_update(self, step: StepContext) -> None:
        self.updates += 1
        self.params = step.update.params
        with torch.no_grad():
            if self.average is None:
                self.average = [p.detach().clone() for p in self.params]
            else:
                update_average(self.average, self.params, self.updates)

    def apply_average(self, params: list[torch.Tensor] | None = None) -> None:
        """Write the averaged weights into the optimizer's parameters (or into ``params``, the same
        tensors' shapes in the optimizer's order): call once training is done, before evaluating or
        saving the model."""
        params = self._targets(params)
        with torch.no_grad():
            for p, mean in zip(params, self.average):
                p.copy_(mean)

    def _targets(self, params: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Where the averaged weights go: ``params`` if given (checked against the average's shapes,
        so that a list in another order or with frozen parameters is refused, not written wrongly),
        else the optimizer's parameters of the last step."""
        if self.average is None:
            raise ValueError("no step was taken yet: there is no averaged model")
        if params is None:
            if self.params is None:
                raise ValueError("the rule has not stepped since it was loaded: pass the optimizer's "
                                 "parameters, apply_average(list(optimizer_parameters))")
            return self.params
        params = list(params)
        if [tuple(p.shape) for p in params] != [tuple(m.shape) for m in self.average]:
            raise ValueError(
                f"apply_average got {len(params)} tensors whose shapes are not those of the "
                f"{len(self.average)} parameters the optimizer steps (in its order); call it without "
                "arguments to write into the optimizer's parameters")
        return params

    @contextmanager
    def averaged(self, params: list[torch.Tensor] | None = None) -> Iterator[None]:
        """The averaged weights in the optimizer's parameters (or ``params``, as for
        :meth:`apply_average`) while the block runs, e.g. to evaluate the model mid-run; the current
        weights are put back after it."""
        params = self._targets(params)
        current = [p.detach().clone() for p in params]
        self.apply_average(params)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(params, current):
                    p.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "distance": self.distance, "gradient_energy": self.gradient_energy,
                "noise_energy_variance": self.noise_energy_variance,
                "walk_variances": list(self.walk_variances), "lr": self.lr, "average": self.average,
                "updates": self.updates, "budget_lr": self.budget_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.origin = None if state["origin"] is None else [t.clone() for t in state["origin"]]
        self.distance, self.gradient_energy = state["distance"], state["gradient_energy"]
        self.noise_energy_variance = state["noise_energy_variance"]
        self.walk_variances = list(state["walk_variances"])
        self.lr, self.updates, self.budget_lr = state["lr"], state["updates"], state["budget_lr"]
        self.average = None if state["average"] is None else [t.clone() for t in state["average"]]
        if self.origin is not None:
            self._origin_scale()  # the walk budget, derived from the origin


def input_scale_factor(input_rms: float | None) -> float:
    """The noise budget's factor for inputs of public root mean square ``input_rms``: ρ_ref/ρ where ρ is
    above ρ_ref = ``INPUT_RMS_REFERENCE`` (the first layer's outputs move ρ/ρ_ref times as far for the same
    walk), else 1 (``None``, unknown, is 1 too)."""
    if input_rms is None:
        return 1.0
    return min(1.0, INPUT_RMS_REFERENCE / input_rms)


def _squared_norms(*parts: list[torch.Tensor]) -> list[float]:
    """‖·‖² of each list of tensors (float64 sums of per-tensor norms), read off the device at once."""
    norms = [torch._foreach_norm(tensors) if tensors else [] for tensors in parts]
    flat = [n for part in norms for n in part]
    by_device: dict[torch.device, list[int]] = {}
    for i, n in enumerate(flat):
        by_device.setdefault(n.device, []).append(i)
    squares = [0.0] * len(flat)
    for indices in by_device.values():  # one transfer per device, in float64 (mixed precisions)
        values = torch.stack([flat[i].to(torch.float64) for i in indices]).square().tolist()
        for i, value in zip(indices, values):
            squares[i] = value
    totals, start = [], 0
    for part in norms:
        totals.append(math.fsum(squares[start:start + len(part)]))
        start += len(part)
    return totals


def update_average(average: list[torch.Tensor], params: list[torch.Tensor], step: int) -> None:
    """DoG's polynomial average after step ``step`` (from 2): x̄ ← x̄ + w·(x − x̄), w = (γ+1)/(t+γ)."""
    torch._foreach_lerp_(average, [p.detach() for p in params], (AVERAGING + 1) / (step + AVERAGING))
