"""What the probe passes do for a GPU, played on a CPU: deterministic kernels, and anchors on each device.

The checks compare probe passes bit for bit, so they run them on deterministic kernels.

On a GPU some kernels differ in their last bits from one run to the next (atomic adds: ``index_add``,
cuDNN's convolution backward, SDPA's flash and memory-efficient backward). Two probe passes on the same
inputs then disagree, and a model that mixes nothing would be refused as mixing. The probes turn on
PyTorch's deterministic algorithms and cuDNN's deterministic convolutions for their passes; a kernel that
has none is named in a refusal as a possible cause. There is no GPU here: a custom ``autograd.Function``
plays such a kernel, nondeterministic unless deterministic algorithms are on, the way PyTorch's kernels
choose (a second one has no deterministic implementation and alerts the way PyTorch's do).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
from support.models import IdentityForward
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.guards import probe
from tunefree.guards.independence import Independence


def _jitter(grad: torch.Tensor) -> torch.Tensor:
    """The last bits of ``grad`` moved at random, as atomic adds in another order move them (a generator
    of its own: the probes' fixed seed does not reach it)."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return grad * (1 + 1e-6 * torch.rand(grad.shape, generator=generator))


class AtomicLikeKernel(IdentityForward):
    """Identity forward; a backward that is deterministic only under deterministic algorithms."""

    @staticmethod
    def backward(ctx, grad):
        return grad.clone() if torch.are_deterministic_algorithms_enabled() else _jitter(grad)


class KernelWithoutDeterministicVersion(IdentityForward):
    """Identity forward; a backward that is never deterministic, and alerts as PyTorch's kernels do."""

    @staticmethod
    def backward(ctx, grad):
        if torch.are_deterministic_algorithms_enabled():
            alert = ("jitter_backward does not have a deterministic implementation, but you set "
                     "'torch.use_deterministic_algorithms(True, warn_only=True)'")
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(alert)
            warnings.warn(alert, stacklevel=2)
        return _jitter(grad)


class Net(nn.Module):
    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.second(self.kernel.apply(torch.tanh(self.first(x))))


def _engine(kernel) -> tunefree.DPEngine:
    torch.manual_seed(0)
    model = Net(kernel)
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(data, batch_size=16), target_delta=1e-5, noise_multiplier=1.0,
                                 steps=4, seed=0, verify_every=1)


def _settings() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark)


def test_a_kernel_deterministic_on_request_trains_with_every_step_checked():
    engine = _engine(AtomicLikeKernel)
    before = _settings()
    assert train(engine, steps=4) == 4
    assert engine.steps == 4
    assert _settings() == before  # the user's settings, as they were


def test_without_deterministic_kernels_the_same_model_is_refused_as_mixing(monkeypatch):
    """What the deterministic probes prevent: the test above fails without them."""
    monkeypatch.setattr(probe, "deterministic_kernels", lambda alerts: contextlib.nullcontext())
    engine = _engine(AtomicLikeKernel)
    with pytest.raises(tunefree.PrivacyError):
        train(engine, steps=1)
    assert engine.steps == 0


def test_a_refusal_names_the_kernel_that_has_no_deterministic_version():
    engine = _engine(KernelWithoutDeterministicVersion)
    before = _settings()
    named = r"jitter_backward\).*use_deterministic_algorithms\(True\)"
    with pytest.raises(tunefree.PrivacyError, match=named):
        train(engine, steps=1)
    assert engine.steps == 0
    assert _settings() == before  # restored after a refusal too


@pytest.mark.parametrize("kernel", [AtomicLikeKernel, KernelWithoutDeterministicVersion])
def test_the_independence_check_runs_on_deterministic_kernels_and_names_those_without(kernel):
    engine = _engine(kernel)
    x = torch.randn(16, 6)
    if kernel is AtomicLikeKernel:
        tunefree.verify_example_independence(engine.model, engine.clipper, (x,))
    else:
        with pytest.raises(tunefree.PrivacyError, match=r"mixes examples.*\(jitter_backward\)"):
            tunefree.verify_example_independence(engine.model, engine.clipper, (x,))


def test_a_strict_setting_of_the_users_stays_strict_in_the_probes():
    """Strict deterministic algorithms raise on a kernel without a deterministic version, in the user's
    own passes and in the probes' alike: the probes do not weaken the user's choice to a warning."""
    seen: list[tuple[bool, bool]] = []

    class Recording(IdentityForward):
        @staticmethod
        def backward(ctx, grad):
            seen.append((torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()))
            return grad.clone()

    previous = _settings()
    torch.use_deterministic_algorithms(True)
    try:
        train(_engine(Recording), steps=1)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    assert seen and all(state == (True, False) for state in seen)


def _warns(text: str) -> type[torch.autograd.Function]:
    """An identity ``autograd.Function`` whose forward warns ``text``: a model's own warning."""
    class Warns(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            warnings.warn(text, UserWarning, stacklevel=2)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.clone()
    return Warns


def test_the_models_own_warnings_still_reach_the_user():
    Warns = _warns("a warning of the model's own")
    with pytest.warns(UserWarning, match="a warning of the model's own") as caught:
        train(_engine(Warns), steps=1)
    assert len(caught) >= 2  # the training forward's, and the probes' passes re-emitted


def test_the_probes_leave_pythons_warnings_machinery_alone():
    """A model's warning is shown as often with every step checked as with the first step only (plus
    the first probe pass's own showing): the probes neither reset the registries that show a warning
    once per place nor show it again at every pass."""
    Warns = _warns("a warning the probes meet")
    def shown(verify_every: int) -> int:
        engine = _engine(Warns)
        engine.guards.of(Independence).verify_every = verify_every
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's own: once per place
            train(engine, steps=4)
        return sum("the probes meet" in str(w.message) for w in caught)

    assert shown(verify_every=1) <= shown(verify_every=10**9) + 1


@pytest.mark.parametrize("message, named", [
    ("Memory Efficient attention defaults to a non-deterministic algorithm. To explicitly enable determinism "
     "call torch.use_deterministic_algorithms(True, warn_only=False).", "Memory Efficient attention"),
    ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
     "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it "
     "uses CuBLAS", "cuBLAS without CUBLAS_WORKSPACE_CONFIG"),
    ("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you set "
     "'torch.use_deterministic_algorithms(True, warn_only=True)'", "adaptive_avg_pool2d_backward_cuda"),
])
def test_each_of_pytorchs_alerts_is_kept_by_its_kernels_name_and_not_shown(message, named):
    alerts: list[str] = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for _ in range(2):
            with probe.deterministic_kernels(alerts):
                warnings.warn(message, UserWarning, stacklevel=1)
    assert alerts == [named]
    assert not shown


def test_on_cuda_attention_runs_in_its_math_form_unless_the_users_setting_is_strict(monkeypatch):
    """SDPA's flash, memory-efficient and cuDNN backward are deterministic only in strict mode; the probes
    run warn-only (strict would raise on kernels without a deterministic version), so they take the math
    form. There is no GPU here: CUDA is declared in use, and the backends the block enables are read."""
    monkeypatch.setattr(probe, "cuda_in_use", lambda: True)
    backends = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [enabled() for enabled in backends]
    with probe.deterministic_kernels([]):
        assert [enabled() for enabled in backends] == [False, False, False, True]
    assert [enabled() for enabled in backends] == before
    previous = _settings()
    torch.use_deterministic_algorithms(True)
    try:
        with probe.deterministic_kernels([]):
            assert [enabled() for enabled in backends] == before
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_a_probes_backward_stays_on_each_outputs_device():
    """Each unit output is tied to an anchor on its own device: a gradient never crosses to the CPU (on
    CUDA that copy waits for the GPU at every unit). Meta tensors stand in for a second device."""
    anchors = probe.Anchors()
    on_cpu = anchors.tie(torch.ones(3, requires_grad=True))
    on_meta = anchors.tie(torch.ones(3, device="meta", requires_grad=True))
    assert [a.device.type for a in anchors.leaves()] == ["cpu", "meta"]
    assert on_meta.device.type == "meta" and torch.equal(on_cpu, torch.ones(3))
    anchors.tie(torch.ones(2, requires_grad=True))
    assert len(anchors.leaves()) == 2  # one per device
