"""Sharded private training on FSDP2 (``fully_shard``): 2 processes on gloo, forked here, against one process.

Each scenario runs in two processes (``gloo_harness``); each rank saves what it saw, gathered to full
tensors, and the tests compare the ranks with each other and with the same run in this process.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo_harness import run_processes
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError

WORLD = 2
N, SEED, STEPS, SIGMA = 64, 7, 3, 1.3
DEADLINE_S = 90  # the whole 2-process scenario, start-up included
COLLECTIVE_TIMEOUT_S = 4
# name: (make_private options, expected batch); the last one leaves ranks with 0 or 1 examples
RUNS = {
    "all-layer auto-s": ({}, 16),
    "per-layer abadi": ({"groups": "per-layer", "clipping": "abadi"}, 16),
    "per-layer, tiny batches": ({"groups": "per-layer"}, 2),
}


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=generator),
                         torch.randint(0, 3, (N,), generator=generator))


def _tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 10, (N, 3), generator=generator),
                         torch.randint(0, 3, (N,), generator=generator))


def _token_model() -> nn.Module:
    """Embedding and LayerNorm (held by the root), then a sharded Linear."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Embedding(10, 5), nn.LayerNorm(5), nn.Flatten(), nn.Linear(15, 3))


def _model() -> nn.Module:
    """Three Linear layers; 5 and 3 rows do not split evenly over 2 ranks (FSDP2 pads the last shard)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def _sharded(model: nn.Module, layers: int = 3) -> nn.Module:
    """FSDP2's recipe: the first ``layers`` Linear layers, then the root (which holds the others)."""
    for layer in [m for m in model if isinstance(m, nn.Linear)][:layers]:
        fully_shard(layer)
    return fully_shard(model)


def _private(model: nn.Module, noise_multiplier: float, batch: int = 16, data=None, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return tunefree.make_private(model, optimizer, DataLoader(data or _data(), batch_size=batch),
                                 noise_multiplier=noise_multiplier, target_delta=1e-3, steps=STEPS,
                                 **{"seed": SEED, **options})


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(engine, steps: int) -> dict:
    """``steps`` private (logical) steps: each step's released gradient (gathered) and this rank's
    examples, then the gathered weights."""
    released, examples = [], []
    batches = iter(engine.data_loader)
    for _ in range(steps):
        x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()
        released.append({n: _full(p.grad) for n, p in engine.model.named_parameters()})
        examples.append(engine.last_step.examples)
    weights = {n: _full(p) for n, p in engine.model.named_parameters()}
    return {"released": released, "examples": examples, "weights": weights, "epsilon": engine.epsilon(),
            "ledger": engine.ledger.state_dict()}


def _run_ranks(scenario, tmp_path: Path) -> list[dict]:
    return run_processes(scenario, tmp_path, world=WORLD, deadline_s=DEADLINE_S,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)


# ---------------------------------------------------------------------------- scenarios (run per rank)
def _training_scenario(rank: int) -> dict:
    out: dict = {name: _train(_private(_sharded(_model()), 0.0, batch, **options), STEPS)
                 for name, (options, batch) in RUNS.items()}
    noisy = _private(_sharded(_model()), SIGMA)
    out["noisy"] = _train(noisy, STEPS)
    out["shard_shapes"] = {n: tuple(p.to_local().shape) for n, p in noisy.model.named_parameters()}
    out["bytes_per_step"] = noisy.optimizer.release.bytes_per_step()
    out["grad_is_sharded"] = all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                                 for p in noisy.model.parameters())
    # Only the first layer sharded on its own; the root holds the other two (and reshards after forward).
    mixed = _private(_sharded(_model(), layers=1), 0.0, **RUNS["per-layer abadi"][0])
    out["mixed"] = _train(mixed, STEPS)
    tokens = _token_model()
    fully_shard(tokens[3])
    out["tokens"] = _train(_private(fully_shard(tokens), 0.0, data=_tokens(), groups="per-layer"), STEPS)
    # The release of zero sums is its noise alone; secret randomness, as in a real run.
    wide = nn.Sequential(nn.Linear(100, 120), nn.Tanh(), nn.Linear(120, 7))
    secret = tunefree.make_private(_sharded(wide, layers=1), torch.optim.SGD(wide.parameters(), lr=0.1),
                                   DataLoader(_data(), batch_size=16), noise_multiplier=SIGMA,
                                   target_delta=1e-3, steps=1)
    noise = [secret.optimizer.release.release({}, secret.clip_thresholds)[0] for _ in range(2)]
    out["noise"] = torch.cat([_full(t).reshape(-1) for draw in noise for t in draw.values()])
    out["local_noise"] = torch.cat([t.to_local().reshape(-1) for t in noise[0].values()])
    out["sensitivity"] = secret.sensitivity
    return out


def _refusal_scenario(rank: int) -> dict:
    out: dict = {"refused": []}
    for options in ({"thresholds": "adaptive"}, {"lr": "auto"}, {"audit_canaries": 8},
                    {"physical_batch_size": 4}):
        try:
            _private(_sharded(_model()), SIGMA, **options)
        except ValueError as error:
            out["refused"].append(str(error))
    for model in (nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.Linear(16, 3)),  # reads its weight
                  nn.Sequential(nn.Linear(6, 3), nn.PReLU())):  # no layer rule: the generic fallback
        try:
            _private(fully_shard(model), SIGMA)
        except ValueError as error:
            out["refused"].append(str(error))
    unsharded_root = _model()
    fully_shard(unsharded_root[0])
    try:
        _private(unsharded_root, SIGMA)
    except ValueError as error:
        out["root not sharded"] = str(error)

    class TiedUse(nn.Module):
        """Reads ``first.weight`` outside ``first``'s forward: an ordinary gradient in FSDP2's tensor."""

        def __init__(self):
            super().__init__()
            self.first, self.last = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.last(torch.tanh(self.first(x) + F.linear(x, self.first.weight)))

    tied = _private(fully_shard(TiedUse()), 0.0)
    x, y = next(iter(tied.data_loader))
    F.cross_entropy(tied.model(x), y).backward()
    before = {n: _full(p) for n, p in tied.model.named_parameters()}
    try:
        tied.optimizer.step()
    except PrivacyError as error:
        out["tied"] = str(error)
    out["tied unchanged"] = all(torch.equal(before[n], _full(p)) for n, p in tied.model.named_parameters())
    out["tied ledger"] = tied.ledger.steps
    # detach(): a plain FSDP2 model again, whose reduce-scatter averages ordinary gradients.
    engine = _private(_sharded(_model()), 0.0)
    model = engine.detach()
    x, y = _data().tensors
    F.cross_entropy(model(x), y).backward()
    out["detached grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def training(tmp_path_factory) -> list[dict]:
    return _run_ranks(_training_scenario, tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: _train(_private(_model(), 0.0, batch, **options), STEPS) for name, (options, batch) in
            RUNS.items()}


@pytest.fixture(scope="module")
def noisy_reference() -> dict:
    return _train(_private(_model(), SIGMA), STEPS)


def _assert_same_run(ours: dict, theirs: dict) -> None:
    for step_ours, step_theirs in zip(ours["released"], theirs["released"], strict=True):
        for name in step_theirs:
            torch.testing.assert_close(step_ours[name], step_theirs[name], rtol=0, atol=1e-6)
    for name in theirs["weights"]:
        torch.testing.assert_close(ours["weights"][name], theirs["weights"][name], rtol=0, atol=1e-6)
    assert any(g.abs().max() > 1e-3 for step in theirs["released"] for g in step.values())  # not all zeros


@pytest.mark.parametrize("run", list(RUNS))
def test_noise_free_release_equals_one_process_on_the_union_batch(training, references, run):
    for rank in training:
        _assert_same_run(rank[run], references[run])
    # every rank's examples together are the one-process batch of each step
    assert [a + b for a, b in zip(training[0][run]["examples"], training[1][run]["examples"])] == \
        references[run]["examples"]


def test_a_rank_with_no_example_takes_part_in_the_step(training):
    examples = [rank["per-layer, tiny batches"]["examples"] for rank in training]
    assert 0 in examples[0] + examples[1]  # the seed gives a step where one rank has no example
    assert any(n >= 2 for n in examples[0] + examples[1])


def test_ranks_end_every_step_bit_identical_with_one_ledger(training):
    first, second = training
    for run in [*RUNS, "noisy", "mixed"]:
        for name, weight in first[run]["weights"].items():
            assert torch.equal(weight, second[run]["weights"][name])
        assert first[run]["ledger"] == second[run]["ledger"]


def test_parameters_stay_sharded_as_fsdp2_shards_them(training):
    """Dim-0 shards of ⌈rows/2⌉ rows; the last layers' 5 and 3 rows give rank 1 a shorter shard."""
    first, second = training
    assert first["shard_shapes"]["4.weight"] == (2, 5) and second["shard_shapes"]["4.weight"] == (1, 5)
    assert first["shard_shapes"]["2.bias"] == (3,) and second["shard_shapes"]["2.bias"] == (2,)
    assert first["grad_is_sharded"] and second["grad_is_sharded"]


def test_epsilon_of_two_ranks_equals_one_process(training, noisy_reference):
    single = noisy_reference
    assert math.isfinite(single["epsilon"])
    assert training[0]["noisy"]["epsilon"] == training[1]["noisy"]["epsilon"] == single["epsilon"]
    assert training[0]["noisy"]["ledger"] == single["ledger"]


def test_noisy_seeded_run_is_the_one_process_run(training, noisy_reference):
    """Seeded: every rank draws one process's noise and keeps its own rows, so the noisy release and
    the weights are those of one process with the same seed, up to rounding."""
    _assert_same_run(training[0]["noisy"], noisy_reference)


def test_a_model_mixing_sharded_layers_and_root_held_layers_is_exact(training, references):
    for rank in training:
        _assert_same_run(rank["mixed"], references["per-layer abadi"])


def test_embedding_and_layer_norm_are_exact(training):
    reference = _train(_private(_token_model(), 0.0, data=_tokens(), groups="per-layer"), STEPS)
    for rank in training:
        _assert_same_run(rank["tokens"], reference)


def test_noise_is_added_once_in_total(training):
    """Total variance σ²S², not W·σ²S² (every rank adding noise) nor σ²S²/W; each rank its own shard."""
    first, second = training
    assert torch.equal(first["noise"], second["noise"])  # the gathered release is the same everywhere
    assert not torch.equal(first["local_noise"][:100], second["local_noise"][:100])  # own streams
    noise = first["noise"].double()
    expected = (SIGMA * first["sensitivity"]) ** 2
    ratio = noise.var().item() / expected
    assert abs(ratio - 1) < 0.05, ratio  # 25 934 draws: the estimate's relative std is 0.9%
    assert abs(noise.mean().item()) < 5 * math.sqrt(expected / noise.numel())


def test_sums_are_communicated_once_padded_to_the_shards(training):
    """Each rank reduce-scatters its clipped sums, padded to 2 equal shards: what FSDP2's own gradient
    reduce-scatter sends for float32 parameters."""
    padded_rows = {"0.weight": 8, "0.bias": 8, "2.weight": 6, "2.bias": 6, "4.weight": 4, "4.bias": 4}
    params = dict(_model().named_parameters())
    expected = sum(rows * params[n].numel() // params[n].shape[0] for n, rows in padded_rows.items())
    assert training[0]["bytes_per_step"] == 4 * expected


def test_refusals_and_a_raw_gradient_fail_closed(tmp_path):
    first, second = _run_ranks(_refusal_scenario, tmp_path)
    for rank in (first, second):
        assert len(rank["refused"]) == 6
        assert "'0' (Conv1d) has a layer rule that reads its parameters" in rank["refused"][4]
        assert "'1' (PReLU) has no layer rule" in rank["refused"][5]
        for option, message in zip(("thresholds='adaptive'", "lr=AutoLR(mode='dog')", "audit_canaries",
                                    "physical_batch_size=4"), rank["refused"]):
            assert f"{option} is not supported with FSDP2 (fully_shard)" in message
        assert "root is not sharded by FSDP2" in rank["root not sharded"]
        assert "fully_shard(model)" in rank["root not sharded"]
        assert "['first.weight'] received ordinary (non-private) gradients" in rank["tied"]
        assert rank["tied unchanged"] and rank["tied ledger"] == 0
    # after detach, FSDP2 reduce-scatters the (ordinary) gradients of both ranks' examples again
    model = _model()
    x, y = _data().tensors
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(first["detached grads"][name], p.grad, rtol=0, atol=1e-6)
