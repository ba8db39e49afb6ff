"""Sharded private training on FSDP2 (``fully_shard``): 2 processes on gloo, forked here, against one process.

Each scenario runs in two processes (``gloo_harness``); each rank saves what it saw, gathered to full
tensors, and the tests compare the ranks with each other and with the same run in this process.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.gloo_harness import run_processes
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError
from tunefree.parallel.fsdp import ShardSink
from tunefree.persample.accumulator import StepAccumulator

WORLD = 2
N, SEED, STEPS, SIGMA = 64, 7, 3, 1.3
DEADLINE_S = 90  # the whole 2-process scenario, start-up included
COLLECTIVE_TIMEOUT_S = 4
# name: (make_private options, expected batch); the last one leaves ranks with 0 or 1 examples
RUNS = {
    "all-layer auto-s": ({}, 16),
    "per-layer abadi": ({"groups": "per-layer", "clipping": "abadi"}, 16),
    "per-layer, tiny batches": ({"groups": "per-layer"}, 2),
    # the counts summed over the ranks: thresholds that move, and Abadi clips at them
    "per-layer adaptive": ({"groups": "per-layer", "clipping": "abadi",
                            "thresholds": tunefree.AdaptiveQuantile(lr=1.0, budget=0.1)}, 16),
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


def _wide_model() -> nn.Module:
    """Five Linear layers, three of 32 x 32: the largest layer holds 1056 of the 3557 parameters."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


class _LiveSums:
    """Bytes of clipped sums alive at once: each storage handed to the accumulator, or to a
    reduce-scatter, counts from then until it is freed (a weak reference to the storage: any tensor
    still holding it, wherever, keeps it counted); the peak is read at each hand-over."""

    def __init__(self):
        self.alive: dict[int, int] = {}
        self.peak = 0

    def track(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.alive:
                self.alive[storage.data_ptr()] = storage.nbytes()
                weakref.finalize(storage, self.alive.pop, storage.data_ptr(), None)
        self.peak = max(self.peak, sum(self.alive.values()))


@contextlib.contextmanager
def _watching(accumulator: type, live: _LiveSums, sent: list | None = None, booked: dict | None = None):
    """Within it: ``live`` tracks every sum booked into ``accumulator`` (the class) and every input of a
    reduce-scatter; ``sent`` lists each reduce-scatter's inputs (copies); ``booked`` keeps a copy of
    each sum booked (zeros for a parameter no example reached)."""
    add, single, chunked = accumulator.add, dist.reduce_scatter_single, dist.reduce_scatter

    def watched_add(self, p, contribution):
        if contribution is not None:
            live.track([contribution])
        if booked is not None:
            booked[p] = torch.zeros(p.shape) if contribution is None else contribution.detach().clone()
        add(self, p, contribution)

    def watched(function, inputs_of):
        def call(*args, **kwargs):
            inputs = inputs_of(*args, **kwargs)
            live.track(inputs)
            if sent is not None:
                sent.append([t.clone() for t in inputs])
            return function(*args, **kwargs)
        return call

    accumulator.add = watched_add
    dist.reduce_scatter_single = watched(single, lambda output, input, **_: [input])
    dist.reduce_scatter = watched(chunked, lambda output, inputs, **_: list(inputs))
    try:
        yield
    finally:
        accumulator.add, dist.reduce_scatter_single, dist.reduce_scatter = add, single, chunked


def _old_release(booked: dict, params: list) -> list[torch.Tensor]:
    """This rank's shards as the release before streaming made them: every full-size sum kept until the
    step, padded to ⌈rows/W⌉·W rows and reduce-scattered then."""
    shards = []
    for p in params:
        full = booked[p]
        rows = math.ceil(full.shape[0] / WORLD)
        padded = torch.cat([full, full.new_zeros(rows * WORLD - full.shape[0], *full.shape[1:])])
        shard = full.new_empty(rows, *full.shape[1:])
        dist.reduce_scatter_single(shard, padded)
        shards.append(shard[:p.to_local().shape[0]])
    return shards


def _streaming(rank: int) -> dict:
    """Per grouping, one noise-free step of the wide model: the peak bytes of sums alive, the
    reduce-scatters sent by the end of the backward pass and during the step, and whether the released
    ``.grad`` shards are those of the release before streaming, bit for bit."""
    out = {}
    for grouping in ("all-layer", "per-layer"):
        engine = _private(_sharded(_wide_model(), layers=5), 0.0, groups=grouping)
        live, sent, booked = _LiveSums(), [], {}
        x, y = next(iter(engine.data_loader))
        with _watching(ShardSink, live, sent, booked):
            F.cross_entropy(engine.model(x), y).backward()
            in_backward = len(sent)
            engine.optimizer.step()
        params = [p for group in engine.groups for p in group.params]
        old = _old_release(booked, params)
        out[grouping] = {
            "peak_bytes": live.peak, "sent_in_backward": in_backward, "sent_in_step": len(sent) - in_backward,
            "params": len(params), "examples": engine.last_step.examples,
            "nonzero sent": any(t.count_nonzero() for inputs in sent for t in inputs),
            "same_as_before": all(torch.equal(p.grad.to_local(), shard / engine.optimizer.expected_batch_size)
                                  for p, shard in zip(params, old))}
    return out


# ---------------------------------------------------------------------------- scenarios (run per rank)
def _training_scenario(rank: int) -> dict:
    out: dict = {name: _train(_private(_sharded(_model()), 0.0, batch, **options), STEPS)
                 for name, (options, batch) in RUNS.items()}
    noisy = _private(_sharded(_model()), SIGMA)
    out["noisy"] = _train(noisy, STEPS)
    out["shard_shapes"] = {n: tuple(p.to_local().shape) for n, p in noisy.model.named_parameters()}
    out["bytes_per_step"] = noisy.optimizer.accumulator.sink.bytes_per_step()
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
    out["streaming"] = _streaming(rank)
    return out


def _refusal_scenario(rank: int) -> dict:
    out: dict = {"refused": []}
    for options in ({"lr": tunefree.HyFreeDP()}, {"lr": "auto"}, {"audit_canaries": 8},
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
        """Reads ``first.weight`` outside ``first``'s forward on the ranks ``readers``: an ordinary
        gradient in FSDP2's tensor there."""

        def __init__(self, readers=range(WORLD)):
            super().__init__()
            self.first, self.last = nn.Linear(6, 6), nn.Linear(6, 3)
            self.readers = readers

        def forward(self, x):
            h = self.first(x)
            if dist.get_rank() in self.readers:
                h = h + F.linear(x, self.first.weight)
            return self.last(torch.tanh(h))

    def refused_step(engine) -> dict:
        """One step, its refusal, and what was sent: each reduce-scatter input, whether it held nonzeros."""
        sent = []
        x, y = next(iter(engine.data_loader))
        with _watching(ShardSink, _LiveSums(), sent):
            F.cross_entropy(engine.model(x), y).backward()
        before = {n: _full(p) for n, p in engine.model.named_parameters()}
        try:
            engine.optimizer.step()
        except PrivacyError as error:
            message = str(error)
        return {"error": message, "ledger": engine.ledger.steps, "sent": len(sent),
                "nonzero sent": any(t.count_nonzero() for inputs in sent for t in inputs),
                "unchanged": all(torch.equal(before[n], _full(p))
                                 for n, p in engine.model.named_parameters())}

    out["tied"] = refused_step(_private(fully_shard(TiedUse()), 0.0))
    # Per-layer groups send their sums inside the backward pass: the raw gradient is foreseen first.
    out["tied per-layer"] = refused_step(_private(fully_shard(TiedUse()), 0.0, groups="per-layer"))
    out["tied on rank 0"] = refused_step(_private(fully_shard(TiedUse(readers={0})), 0.0, groups="per-layer"))
    # detach(): a plain FSDP2 model again, whose reduce-scatter averages ordinary gradients.
    engine = _private(_sharded(_model()), 0.0)
    model = engine.detach()
    x, y = _data().tensors
    F.cross_entropy(model(x), y).backward()
    out["detached grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    return out


def _failed_rank_scenario(rank: int) -> dict:
    """A clean step, then a step whose norms overflow on rank 0 only (an infinite input): rank 0 refuses
    it at the end of its backward pass, after its sums were sent, and leaves the run; rank 1 must not
    release what it received."""
    engine = _private(_sharded(_model()), SIGMA)
    shards = list(engine.model.parameters())  # the module may hold unsharded ones after a failed backward
    batches = iter(engine.data_loader)
    for step in range(2):
        x, y = next(batches)
        if step == 1 and rank == 0:  # the first example's input made infinite (an example's own change)
            x = torch.where(torch.arange(len(x))[:, None] == 0, math.inf, x)
        engine.optimizer.zero_grad()
        before = [p.to_local().clone() for p in shards]
        try:
            F.cross_entropy(engine.model(x), y).backward()
            engine.optimizer.step()
        except Exception as error:  # noqa: BLE001 - rank 0's PrivacyError, rank 1's failed collective
            return {"failed at step": step + 1, "error": f"{type(error).__name__}: {error}",
                    "ledger": engine.ledger.steps,
                    "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, shards))}
    return {"failed at step": None}


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
@pytest.mark.distributed
def test_noise_free_release_equals_one_process_on_the_union_batch(training, references, run):
    for rank in training:
        _assert_same_run(rank[run], references[run])
    # every rank's examples together are the one-process batch of each step
    assert [a + b for a, b in zip(training[0][run]["examples"], training[1][run]["examples"])] == \
        references[run]["examples"]


@pytest.mark.distributed
def test_a_rank_with_no_example_takes_part_in_the_step(training):
    examples = [rank["per-layer, tiny batches"]["examples"] for rank in training]
    assert 0 in examples[0] + examples[1]  # the seed gives a step where one rank has no example
    assert any(n >= 2 for n in examples[0] + examples[1])


@pytest.mark.distributed
def test_ranks_end_every_step_bit_identical_with_one_ledger(training):
    first, second = training
    for run in [*RUNS, "noisy", "mixed"]:
        for name, weight in first[run]["weights"].items():
            assert torch.equal(weight, second[run]["weights"][name])
        assert first[run]["ledger"] == second[run]["ledger"]


@pytest.mark.distributed
def test_parameters_stay_sharded_as_fsdp2_shards_them(training):
    """Dim-0 shards of ⌈rows/2⌉ rows; the last layers' 5 and 3 rows give rank 1 a shorter shard."""
    first, second = training
    assert first["shard_shapes"]["4.weight"] == (2, 5) and second["shard_shapes"]["4.weight"] == (1, 5)
    assert first["shard_shapes"]["2.bias"] == (3,) and second["shard_shapes"]["2.bias"] == (2,)
    assert first["grad_is_sharded"] and second["grad_is_sharded"]


@pytest.mark.distributed
def test_epsilon_of_two_ranks_equals_one_process(training, noisy_reference):
    single = noisy_reference
    assert math.isfinite(single["epsilon"])
    assert training[0]["noisy"]["epsilon"] == training[1]["noisy"]["epsilon"] == single["epsilon"]
    assert training[0]["noisy"]["ledger"] == single["ledger"]


@pytest.mark.distributed
def test_noisy_seeded_run_is_the_one_process_run(training, noisy_reference):
    """Seeded: every rank draws one process's noise and keeps its own rows, so the noisy release and
    the weights are those of one process with the same seed, up to rounding."""
    _assert_same_run(training[0]["noisy"], noisy_reference)


@pytest.mark.distributed
def test_a_model_mixing_sharded_layers_and_root_held_layers_is_exact(training, references):
    for rank in training:
        _assert_same_run(rank["mixed"], references["per-layer abadi"])


@pytest.mark.distributed
def test_embedding_and_layer_norm_are_exact(training):
    reference = _train(_private(_token_model(), 0.0, data=_tokens(), groups="per-layer"), STEPS)
    for rank in training:
        _assert_same_run(rank["tokens"], reference)


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_sums_are_communicated_once_padded_to_the_shards(training):
    """Each rank reduce-scatters its clipped sums, padded to 2 equal shards: what FSDP2's own gradient
    reduce-scatter sends for float32 parameters."""
    padded_rows = {"0.weight": 8, "0.bias": 8, "2.weight": 6, "2.bias": 6, "4.weight": 4, "4.bias": 4}
    params = dict(_model().named_parameters())
    expected = sum(rows * params[n].numel() // params[n].shape[0] for n, rows in padded_rows.items())
    assert training[0]["bytes_per_step"] == 4 * expected


@pytest.mark.distributed
def test_clipped_sums_are_sent_during_the_backward_pass(training):
    """Each parameter's sum is reduce-scattered once, before the backward pass returns; the step sends
    none (its one collective is the 4-byte agreement)."""
    for rank in training:
        for seen in rank["streaming"].values():
            assert seen["sent_in_backward"] == seen["params"] == 10 and seen["sent_in_step"] == 0
            assert seen["nonzero sent"] and seen["examples"] > 0


@pytest.mark.distributed
def test_a_rank_holds_one_layer_of_full_size_sums_not_the_model(training):
    """Measured: the bytes of sums alive at once on a rank (every storage booked or sent, until freed)
    stay within the largest layer (plus one padded shard), for both groupings. The same probe on one
    process, whose accumulator keeps every sum until the step, sees the whole model."""
    model = _wide_model()
    largest = max(sum(p.numel() for p in m.parameters()) for m in model if isinstance(m, nn.Linear))
    shard = max(math.ceil(p.shape[0] / WORLD) * (p.numel() // p.shape[0]) for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert (largest, total) == (1056, 3557)
    live = _LiveSums()
    engine = _private(model, 0.0)
    x, y = next(iter(engine.data_loader))
    with _watching(StepAccumulator, live):
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()
    assert live.peak >= 4 * total
    for rank in training:
        for seen in rank["streaming"].values():
            assert 4 * largest <= seen["peak_bytes"] <= 4 * (largest + shard), seen["peak_bytes"]


@pytest.mark.distributed
def test_released_shards_are_bit_identical_to_the_release_at_the_step(training):
    """Noise-free: the released ``.grad`` shards equal, bit for bit, those of the release before streaming
    (every full-size sum kept to the step, then padded and reduce-scattered)."""
    for rank in training:
        for seen in rank["streaming"].values():
            assert seen["same_as_before"]


@pytest.mark.distributed
def test_a_rank_failing_after_its_sums_were_sent_stops_every_rank(tmp_path):
    """Streaming sends the sums before the step's checks; the step's agreement keeps the other ranks from
    releasing them: rank 1 fails at it (rank 0 never arrives) with its weights and ledger untouched."""
    first, second = _run_ranks(_failed_rank_scenario, tmp_path)
    assert first["failed at step"] == second["failed at step"] == 2
    assert "PrivacyError" in first["error"] and "NaN, infinite" in first["error"]
    assert "PrivacyError" not in second["error"]
    for rank in (first, second):
        assert rank["unchanged"] and rank["ledger"] == 1


@pytest.mark.distributed
def test_refusals_and_a_raw_gradient_fail_closed(tmp_path):
    first, second = _run_ranks(_refusal_scenario, tmp_path)
    for rank in (first, second):
        assert len(rank["refused"]) == 6
        assert "'0' (Conv1d) has a layer rule that reads its parameters" in rank["refused"][4]
        assert "'1' (PReLU) has no layer rule" in rank["refused"][5]
        refused = ("lr=HyFreeDP()", "lr=DoG()", "audit_canaries",
                   "physical_batch_size=4")
        for option, message in zip(refused, rank["refused"]):
            assert f"{option} is not supported with FSDP2 (fully_shard)" in message
        assert "root is not sharded by FSDP2" in rank["root not sharded"]
        assert "fully_shard(model)" in rank["root not sharded"]
        for run in ("tied", "tied per-layer"):
            assert "['first.weight'] received ordinary (non-private) gradients" in rank[run]["error"]
            # every rank sent zeros in place of its sums (once per parameter), and nothing was applied
            assert rank[run]["sent"] == 4 and not rank[run]["nonzero sent"]
            assert rank[run]["unchanged"] and rank[run]["ledger"] == 0
    # A raw gradient on rank 0 only: rank 0 sends zeros, rank 1 its sums; both refuse the step.
    assert "['first.weight'] received ordinary" in first["tied on rank 0"]["error"]
    assert "parameters on another rank received ordinary" in second["tied on rank 0"]["error"]
    assert not first["tied on rank 0"]["nonzero sent"] and second["tied on rank 0"]["nonzero sent"]
    for rank in (first, second):
        assert rank["tied on rank 0"]["unchanged"] and rank["tied on rank 0"]["ledger"] == 0
    # after detach, FSDP2 reduce-scatters the (ordinary) gradients of both ranks' examples again
    model = _model()
    x, y = _data().tensors
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(first["detached grads"][name], p.grad, rtol=0, atol=1e-6)
