"""Data-parallel private training: 2 processes on gloo, spawned here, against one process.

Each scenario runs in two processes started with ``torch.multiprocessing`` (a free port, a process-group
timeout and a deadline, so that a hang fails instead of blocking); each rank saves what it saw and the
test compares the ranks with each other and with the same run in this process.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.gloo_harness import run_processes
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError

WORLD = 2
N, BATCH, SEED = 64, 16, 7
STEPS = 4
SIGMA = 1.3
DEADLINE_S = 90  # the whole 2-process scenario, start-up included
COLLECTIVE_TIMEOUT_S = 4
GROUPED = {"groups": "per-layer", "physical_batch_size": 3, "clipping": "abadi"}
# Adaptive thresholds that move visibly in a few steps; Abadi clips at them, so the release shows them.
ADAPTIVE = {"groups": "per-layer", "clipping": "abadi",
            "thresholds": tunefree.AdaptiveQuantile(lr=1.0, budget=0.1)}
HYFREEDP = {"lr": tunefree.HyFreeDP(interval=2)}
CANARIES = 8


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=generator),
                         torch.randint(0, 3, (N,), generator=generator))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _private(model: nn.Module, noise_multiplier: float, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return tunefree.make_private(model, optimizer, DataLoader(_data(), batch_size=BATCH),
                                 noise_multiplier=noise_multiplier, target_delta=1e-3, steps=STEPS,
                                 **{"seed": SEED, **options})


def _train(engine, steps: int, with_losses: bool = False) -> list[dict[str, torch.Tensor]]:
    """``steps`` private (logical) steps; the released gradient of each (``.grad`` after the step).
    ``with_losses``: the closure gives the batch's per-sample losses (HyFreeDP's learning rate)."""
    released = []
    batches = iter(engine.data_loader)
    for _ in range(steps):
        last = False
        while not last:  # the physical micro-batches of one logical batch
            x, y = next(batches)
            last = engine.schedule.ends_logical
            engine.optimizer.zero_grad()
            F.cross_entropy(engine.model(x), y).backward()
            engine.optimizer.step((lambda x=x, y=y: F.cross_entropy(engine.model(x), y, reduction="none"))
                                  if with_losses else None)
        released.append({n: p.grad.clone() for n, p in engine.clipper.model.named_parameters()})
    return released


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.clipper.model.named_parameters()}


# ---------------------------------------------------------------------------- the 2-process harness
def _run_ranks(scenario, tmp_path: Path) -> list[dict]:
    return run_processes(scenario, tmp_path, world=WORLD, deadline_s=DEADLINE_S,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)


# ---------------------------------------------------------------------------- scenarios (run per rank)
def _training_scenario(rank: int) -> dict:
    """A noise-free and a noisy seeded run of STEPS steps, and the noise of the release alone."""
    out: dict = {}
    quiet = _private(DistributedDataParallel(_model()), 0.0)
    out["quiet_released"] = _train(quiet, STEPS)
    grouped = _private(DistributedDataParallel(_model()), 0.0, **GROUPED)
    out["grouped_released"] = _train(grouped, STEPS)
    adaptive = _private(DistributedDataParallel(_model()), 0.0, **ADAPTIVE)
    out["adaptive_released"] = _train(adaptive, STEPS)
    noisy = _private(DistributedDataParallel(_model()), SIGMA)
    _train(noisy, 2)
    out["state_after_2"] = noisy.state_dict()
    out["weights_after_2"] = _weights(noisy)
    out["optimizer_after_2"] = noisy.optimizer.state_dict()
    _train(noisy, STEPS - 2)
    out["noisy_weights"] = _weights(noisy)
    out["ledger"] = noisy.ledger.state_dict()
    out["epsilon"] = noisy.epsilon()
    out["bytes_per_step"] = noisy.parallel.bytes_per_step(noisy.groups)
    dog = _private(DistributedDataParallel(_model()), SIGMA, lr="auto")
    _train(dog, STEPS)
    out["dog_weights"], out["dog_lrs"] = _weights(dog), list(dog.lr_rule.history)
    # The release of zero sums is its noise alone; secret randomness, as in a real run.
    wide = nn.Linear(200, 50)
    secret = tunefree.make_private(DistributedDataParallel(wide), torch.optim.SGD(wide.parameters(), lr=0.1),
                                   DataLoader(_data(), batch_size=BATCH), noise_multiplier=SIGMA,
                                   target_delta=1e-3, steps=1)
    release = secret.optimizer.release
    out["noise"] = torch.cat([torch.cat([t.reshape(-1) for t in release.release({}, secret.clip_thresholds)[0]
                                         .values()]) for _ in range(4)])
    out["sensitivity"] = secret.sensitivity
    out["detached_syncs"] = secret.detach().require_backward_grad_sync
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _private(_model(), SIGMA)  # a plain model: one run per process, which is said
    out["plain_model_warnings"] = [str(w.message) for w in caught]
    return out


def _components_scenario(rank: int) -> dict:
    """Noisy seeded runs with adaptive thresholds and with HyFreeDP's learning rate:
    their counts and losses are summed over the ranks and noised once."""
    out: dict = {}
    adaptive = _private(DistributedDataParallel(_model()), SIGMA, **ADAPTIVE)
    out["adaptive_thresholds"] = _train_noting_thresholds(adaptive, STEPS)
    out["adaptive_weights"], out["adaptive_ledger"] = _weights(adaptive), adaptive.ledger.state_dict()
    secret = _private(DistributedDataParallel(_model()), SIGMA, **{**ADAPTIVE, "seed": None})
    out["secret_thresholds"] = _train_noting_thresholds(secret, STEPS)  # each rank noises its own slice
    hyfreedp = _private(DistributedDataParallel(_model()), 2.0, **HYFREEDP)
    _train(hyfreedp, STEPS, with_losses=True)
    out["hyfreedp_lrs"] = [fit.lr for fit in hyfreedp.lr_rule.history]
    out["hyfreedp_weights"], out["hyfreedp_ledger"] = _weights(hyfreedp), hyfreedp.ledger.state_dict()
    for name, seed in (("canaries", SEED), ("secret canaries", None)):
        audited = _private(DistributedDataParallel(_model()), SIGMA, audit_canaries=CANARIES, seed=seed)
        _train(audited, STEPS)
        canaries = audited.canaries
        out[name] = {"included": canaries.included, "z": canaries.z, "shift": canaries.shift,
                     "weights": _weights(audited), "epsilon": audited.epsilon()}
    return out


def _train_noting_thresholds(engine, steps: int) -> list[dict[str, float]]:
    thresholds = []
    for _ in range(steps):
        _train(engine, 1)
        thresholds.append(engine.clip_thresholds)
    return thresholds


def _failure_scenario(rank: int) -> dict:
    """Ranks set up differently are refused; then rank 1 fails inside a step and rank 0 must not update."""
    out: dict = {"refused": []}
    for options in ({"poisson_sampling": False},):
        try:
            _private(DistributedDataParallel(_model()), SIGMA, **options)
        except ValueError as error:
            out["refused"].append(str(error))
    from torch.distributed.fsdp import fully_shard
    layers_only = _model()
    fully_shard(layers_only[0])  # FSDP2 on a layer but not on the root: refused
    try:
        _private(layers_only, SIGMA)
    except ValueError as error:
        out["refused"].append(str(error))
    try:
        _private(DistributedDataParallel(_model()), SIGMA if rank == 0 else 2 * SIGMA)
    except PrivacyError as error:
        out["mismatch"] = str(error)
    try:  # rank 0 secret (noising its slice only), rank 1 seeded (leaving all noise to rank 0)
        _private(DistributedDataParallel(_model()), SIGMA, seed=None if rank == 0 else SEED)
    except PrivacyError as error:
        out["randomness mismatch"] = str(error)
    engine = _private(DistributedDataParallel(_model()), SIGMA)
    _train(engine, 1)
    before, steps_before = _weights(engine), engine.ledger.steps
    x, y = next(iter(engine.data_loader))
    engine.optimizer.zero_grad()
    F.cross_entropy(engine.model(x), y).backward()
    if rank == 1:  # frozen after make_private: rank 1 refuses the step before releasing anything
        engine.clipper.model[0].bias.requires_grad_(False)
    try:
        engine.optimizer.step()
        out["step"] = "completed"
    except Exception as error:  # rank 1: PrivacyError; rank 0: the collective fails
        out["step"] = type(error).__name__
    out["unchanged"] = all(torch.equal(before[n], w) for n, w in _weights(engine).items())
    out["ledger_steps"] = (steps_before, engine.ledger.steps)
    return out


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def training(tmp_path_factory) -> list[dict]:
    return _run_ranks(_training_scenario, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("run, options", [("quiet_released", {}), ("grouped_released", GROUPED),
                                          ("adaptive_released", ADAPTIVE)])
@pytest.mark.distributed
def test_noise_free_release_equals_one_process_on_the_union_batch(training, run, options):
    reference = _train(_private(_model(), 0.0, **options), STEPS)
    for rank in training:
        for ours, theirs in zip(rank[run], reference):
            for name in theirs:
                torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
    assert any(g.abs().max() > 1e-3 for g in reference[0].values())  # the comparison is not of zeros


@pytest.mark.distributed
def test_ranks_end_every_step_bit_identical_with_one_ledger(training):
    first, second = training
    for name, weight in first["noisy_weights"].items():
        assert torch.equal(weight, second["noisy_weights"][name])
    assert first["ledger"] == second["ledger"]
    assert first["epsilon"] == second["epsilon"]


@pytest.mark.distributed
def test_every_rank_saves_the_same_checkpoint(training):
    """Seeded: rank 1 keeps its noise stream where rank 0's is, so either checkpoint resumes the run."""
    first, second = (copy.deepcopy(rank["state_after_2"]) for rank in training)
    noise_states = [state["randomness"].pop("noise") for state in (first, second)]
    assert noise_states[0].keys() == noise_states[1].keys() == {"cpu"}
    assert torch.equal(noise_states[0]["cpu"], noise_states[1]["cpu"])
    assert first == second


@pytest.mark.distributed
def test_epsilon_of_two_ranks_equals_one_process(training):
    single = _private(_model(), SIGMA)
    _train(single, STEPS)
    assert math.isfinite(single.epsilon())
    assert training[0]["epsilon"] == single.epsilon()


@pytest.mark.distributed
def test_noise_is_added_once_in_total(training):
    """Total variance σ²S², not W·σ²S² (every rank adding noise) nor σ²S²/W; identical on both ranks."""
    first, second = training
    assert torch.equal(first["noise"], second["noise"])
    assert (first["noise"] != 0).all()  # each rank noises its own slice: together, every coordinate
    noise = first["noise"].double()
    expected = (SIGMA * first["sensitivity"]) ** 2
    ratio = noise.var().item() / expected
    assert abs(ratio - 1) < 0.05, ratio  # 40 200 draws: the estimate's relative std is 0.7%
    assert abs(noise.mean().item()) < 5 * math.sqrt(expected / noise.numel())


@pytest.mark.distributed
def test_noisy_run_matches_one_process_with_the_same_seed(training):
    """Same seed: same union batches, same noise (rank 0's stream) → the same weights up to rounding."""
    single = _private(_model(), SIGMA)
    _train(single, STEPS)
    for name, weight in _weights(single).items():
        torch.testing.assert_close(training[0]["noisy_weights"][name], weight, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_automatic_learning_rate_is_the_same_on_every_rank_and_as_in_one_process(training):
    """lr='auto' (DoG within its noise budget) reads only the released gradient and the weights, which
    every rank holds identically: the same learning rates, bit-identical weights, and those of the
    one-process run with the same seed up to the all-reduce's rounding."""
    first, second = training
    assert first["dog_lrs"] == second["dog_lrs"] and len(first["dog_lrs"]) == STEPS
    for name, weight in first["dog_weights"].items():
        assert torch.equal(weight, second["dog_weights"][name])
    single = _private(_model(), SIGMA, lr="auto")
    _train(single, STEPS)
    assert first["dog_lrs"] == pytest.approx(single.lr_rule.history, rel=1e-5)
    for name, weight in _weights(single).items():
        torch.testing.assert_close(first["dog_weights"][name], weight, rtol=0, atol=1e-5)


@pytest.mark.parametrize("source", [0, 1])
@pytest.mark.distributed
def test_a_two_rank_checkpoint_resumes_in_one_process(training, source):
    """The sampler re-partitions exactly (step t's union batch does not depend on the world size), so a
    checkpoint of either rank resumes in any world size; its fingerprint does not hold the world size."""
    saved = training[source]
    model = _model()
    model.load_state_dict(saved["weights_after_2"])
    resumed = _private(model, SIGMA)
    resumed.optimizer.load_state_dict(saved["optimizer_after_2"])
    resumed.load_state_dict(saved["state_after_2"])
    _train(resumed, STEPS - 2)
    assert resumed.ledger.state_dict() == saved["ledger"]
    for name, weight in _weights(resumed).items():
        torch.testing.assert_close(saved["noisy_weights"][name], weight, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_sums_are_communicated_once_in_the_parameters_dtype(training):
    params = sum(p.numel() for p in _model().parameters())
    assert training[0]["bytes_per_step"] == 4 * params  # what non-private DDP all-reduces for float32


@pytest.mark.distributed
def test_detach_gives_ddp_its_gradient_synchronisation_back(training):
    assert training[0]["detached_syncs"] is True


@pytest.mark.distributed
def test_a_plain_model_under_several_processes_is_warned_about(training):
    assert any("not wrapped in DistributedDataParallel" in m for m in training[0]["plain_model_warnings"])


@pytest.mark.distributed
def test_a_failing_rank_fails_the_step_on_every_rank_without_an_update(tmp_path):
    first, second = _run_ranks(_failure_scenario, tmp_path)
    assert len(first["refused"]) == 2
    assert "its root is not sharded by FSDP2" in first["refused"][1]
    assert "poisson_sampling=False is not supported with DistributedDataParallel" in first["refused"][0]
    assert "rank 1 was set up differently" in first["mismatch"]
    assert "rank 0 was set up differently" in second["mismatch"]
    for rank in (first, second):
        assert "differs in ['randomness']" in rank["randomness mismatch"]
    assert second["step"] == "PrivacyError"
    assert first["step"] != "completed"
    for rank in (first, second):
        assert rank["unchanged"]
        assert rank["ledger_steps"] == (1, 1)


@pytest.fixture(scope="module")
def components(tmp_path_factory) -> list[dict]:
    return _run_ranks(_components_scenario, tmp_path_factory.mktemp("ddp-components"))


@pytest.mark.distributed
def test_adaptive_thresholds_under_ddp_are_those_of_one_process(components):
    """The counts are every rank's, summed, and noised once (rank 0 draws the seeded noise as one process
    does): the same thresholds on every rank, those of the one-process run with the same seed up to the
    all-reduce's rounding, and one ledger, that of one process."""
    first, second = components
    assert first["adaptive_thresholds"] == second["adaptive_thresholds"]
    assert first["adaptive_ledger"] == second["adaptive_ledger"]
    single = _private(_model(), SIGMA, **ADAPTIVE)
    thresholds = _train_noting_thresholds(single, STEPS)
    for ours, theirs in zip(first["adaptive_thresholds"], thresholds, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-9)
    assert thresholds[-1] != {g.name: g.threshold for g in single.groups}  # they moved
    assert first["secret_thresholds"] == second["secret_thresholds"]  # secret noise: the same on each rank
    assert first["secret_thresholds"][-1] != thresholds[-1]
    assert first["adaptive_ledger"] == single.ledger.state_dict()
    for name, weight in _weights(single).items():
        torch.testing.assert_close(first["adaptive_weights"][name], weight, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_hyfreedp_under_ddp_fits_the_learning_rate_of_one_process(components):
    """Each rank's clipped loss sums are summed over the ranks and noised once (each coordinate's noise added
    by one rank): the same learning rates and weights on every rank, and those of one process."""
    first, second = components
    assert first["hyfreedp_lrs"] == second["hyfreedp_lrs"] and len(first["hyfreedp_lrs"]) == 2
    for name, weight in first["hyfreedp_weights"].items():
        assert torch.equal(weight, second["hyfreedp_weights"][name])
    single = _private(_model(), 2.0, **HYFREEDP)
    _train(single, STEPS, with_losses=True)
    expected = [fit.lr for fit in single.lr_rule.history]
    assert first["hyfreedp_lrs"] == pytest.approx(expected, rel=1e-6)
    assert first["hyfreedp_ledger"] == single.ledger.state_dict()
    for name, weight in _weights(single).items():
        torch.testing.assert_close(first["hyfreedp_weights"][name], weight, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_audit_canaries_under_ddp_are_one_set_released_once_as_in_one_process(components):
    """The ranks share the canaries (a seeded run's stream, or rank 0's secret seed), rank 0 alone adds
    their contributions, and the block is reduced and noised with the model's sums: every rank observes
    the same releases, those of the one-process run with the same seed, at the same ε."""
    first, second = components
    for name in ("canaries", "secret canaries"):
        assert (first[name]["included"] == second[name]["included"]).all()
        assert all((a == b).all() for a, b in zip(first[name]["z"], second[name]["z"], strict=True))
        assert first[name]["shift"] == second[name]["shift"] and len(first[name]["z"]) == STEPS
    single = _private(_model(), SIGMA, audit_canaries=CANARIES)
    _train(single, STEPS)
    assert (first["canaries"]["included"] == single.canaries.included).all()
    for ours, theirs in zip(first["canaries"]["z"], single.canaries.z, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)  # the all-reduce's rounding, in noise stds
    assert first["canaries"]["epsilon"] == single.epsilon()
    for name, weight in _weights(single).items():  # the model's release is untouched by the canaries
        torch.testing.assert_close(first["canaries"]["weights"][name], weight, rtol=0, atol=1e-5)


def test_sharded_sampler_partitions_the_one_process_batch():
    """With a seed, the shards of step t are a partition of the one-process batch of step t."""
    from tunefree.data.poisson import PoissonBatchSampler, StepSchedule
    from tunefree.privacy.randomness import SeededSource

    def batches(shard):
        sampler = PoissonBatchSampler(N, 0.3, 5, SeededSource(SEED), StepSchedule(), shard=shard)
        return list(sampler)

    whole = batches((0, 1))
    for world in (2, 3):
        shards = [batches((r, world)) for r in range(world)]
        for t, batch in enumerate(whole):
            parts = [shard[t] for shard in shards]
            assert sorted(i for part in parts for i in part) == batch
            assert all(i % world == r for r, part in enumerate(parts) for i in part)
    with pytest.raises(ValueError, match="rank"):
        PoissonBatchSampler(N, 0.3, 5, SeededSource(SEED), StepSchedule(), shard=(2, 2))


def test_data_parallel_in_one_process_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="nn.DataParallel .* is not supported.*DistributedDataParallel"):
        _private(nn.DataParallel(model), 1.0)


def test_distributed_sampler_is_refused():
    from torch.utils.data.distributed import DistributedSampler
    data = _data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    model = _model()
    with pytest.raises(ValueError, match="DistributedSampler"):
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                              noise_multiplier=1.0, target_delta=1e-3, steps=1)
