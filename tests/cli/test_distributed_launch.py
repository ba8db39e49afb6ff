"""`tunefree train --nproc-per-node 2` through torchrun, and a rank killed inside a step.

The command-line run is compared with the same run in one process (its ε, its private standardisation,
its outputs written once). The kill scenario runs two ranks spawned here on gloo: rank 1 dies (SIGKILL)
inside the release, before its all-reduce; rank 0 must fail the step without recording or applying it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.cli.main import main
from tunefree.cli.training import TrainConfig, train

WORLD = 2
DEADLINE_S = 60
COLLECTIVE_TIMEOUT_S = 4
STEPS, SEED = 2, 11


def _table(path: Path, rows: int = 6000) -> str:
    """A CSV with two numeric columns of very different scales (privately standardised) and a label."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 2, generator=generator) * torch.tensor([1.0, 1000.0])
    label = (x[:, 0] + x[:, 1] / 1000 > 0).long()
    lines = ["a,b,label"] + [f"{a:.4f},{b:.2f},{c}" for (a, b), c in zip(x.tolist(), label.tolist())]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.distributed
def test_train_in_two_processes_spends_the_epsilon_of_one_and_writes_once(tmp_path, capfd):
    data = _table(tmp_path / "t.csv")
    # ε = 1 and large batches: the noise is calibrated in a few seconds per process
    flags = ["--dataset", data, "--epsilon", "1", "--steps", str(STEPS), "--seed", str(SEED),
             "--batch-size", "512", "--hidden", "8", "--quiet"]
    status = main(["train", "--nproc-per-node", str(WORLD), *flags, "--json", str(tmp_path / "two.json"),
                   "--out", str(tmp_path / "run")])
    printed = capfd.readouterr().out
    assert status == 0
    two = json.loads((tmp_path / "two.json").read_text())
    one = train(TrainConfig(dataset=data, epsilon=1.0, epochs=None, steps=STEPS, seed=SEED, batch_size=512,
                            hidden=(8,), quiet=True))
    assert (two["processes"], one["processes"]) == (WORLD, 1)
    # the releases outside the steps (label set, standardisation) were made once, and accounted:
    assert [r["release"] for r in two["preprocessing"]] == ["class labels", "standardisation"]
    assert two["preprocessing"] == one["preprocessing"]
    assert two["epsilon"] == one["epsilon"]
    assert 0.5 < two["epsilon"] <= 1.0
    assert two["steps"] == one["steps"] == STEPS
    assert printed.count("test accuracy") == 1  # rank 0 alone reports
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["epsilon"] == one["epsilon"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "step"] == list(range(1, STEPS + 1))


def test_options_not_reduced_across_ranks_are_refused_before_launching(capsys):
    status = main(["train", "--nproc-per-node", "2", "--thresholds", "adaptive", "--steps", "1"])
    assert status == 2
    assert "--thresholds adaptive cannot run in several processes" in capsys.readouterr().err
    status = main(["train", "--nproc-per-node", "2", "--audit-canaries", "100", "--steps", "1"])
    assert status == 2
    assert "--audit-canaries cannot run in several processes" in capsys.readouterr().err


# ---------------------------------------------------------------------------- two ranks spawned here
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _spawn(scenario, tmp_path: Path) -> list[mp.Process]:
    """Run ``scenario(rank, port, out)`` in ``WORLD`` forked processes and wait for each (one may be
    killed: the others still finish); the processes, ended."""
    import torch._dynamo  # noqa: F401  (imported once here, not in each forked rank)

    context = mp.start_processes(scenario, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + DEADLINE_S
    for process in context.processes:
        process.join(max(deadline - time.monotonic(), 1))
        if process.is_alive():
            process.kill()
            pytest.fail(f"a rank did not finish within {DEADLINE_S} s")
    return context.processes


def _once_scenario(rank: int, port: int, out: str) -> None:
    from tunefree.cli.launch import once_on_rank_zero

    _join_group(rank, port)
    calls = []

    def release() -> dict:
        calls.append(rank)
        return {"made by": rank, "value": torch.randn(3)}

    def failing() -> None:
        raise ValueError(f"too few rows on rank {rank}")

    result = {"released": once_on_rank_zero(release), "calls": calls}
    try:
        once_on_rank_zero(failing)
    except ValueError as error:
        result["error"] = str(error)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_release_outside_the_steps_is_made_once_and_seen_by_every_rank(tmp_path):
    for process in _spawn(_once_scenario, tmp_path):
        assert process.exitcode == 0
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert (first["calls"], second["calls"]) == ([0], [])
    assert second["released"]["made by"] == 0
    assert torch.equal(first["released"]["value"], second["released"]["value"])
    assert first["error"] == second["error"] == "too few rows on rank 0"  # every rank fails, none waits


def _private_engine():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=generator),
                         torch.randint(0, 3, (64,), generator=generator))
    return tunefree.make_private(DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.5),
                                 DataLoader(data, batch_size=16), noise_multiplier=1.0, target_delta=1e-3,
                                 steps=4, seed=SEED)


def _one_step(engine) -> None:
    x, y = next(iter(engine.data_loader))
    engine.optimizer.zero_grad()
    F.cross_entropy(engine.model(x), y).backward()
    engine.optimizer.step()


def _killed_rank_scenario(rank: int, port: int, out: str) -> None:
    _join_group(rank, port)
    engine = _private_engine()
    _one_step(engine)
    weights = {n: p.detach().clone() for n, p in engine.clipper.model.named_parameters()}
    if rank == 1:  # dies inside the step, after clipping, before its all-reduce
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        engine.optimizer.release.release = die
    started = time.monotonic()
    try:
        _one_step(engine)
        outcome = "completed"
    except Exception as error:  # the collective fails: the peer is gone
        outcome = type(error).__name__
    torch.save({"outcome": outcome, "seconds": time.monotonic() - started,
                "unchanged": all(torch.equal(weights[n], p) for n, p in
                                 engine.clipper.model.named_parameters()),
                "ledger_steps": engine.ledger.steps}, Path(out) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_a_rank_killed_inside_the_step_fails_the_step_on_the_other_without_an_update(tmp_path):
    survivor, killed = _spawn(_killed_rank_scenario, tmp_path)
    assert killed.exitcode == -signal.SIGKILL
    assert survivor.exitcode == 0
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result["outcome"] != "completed"
    assert result["unchanged"]  # no partial update
    assert result["ledger_steps"] == 1  # the first step only: every applied update is accounted
    assert result["seconds"] < COLLECTIVE_TIMEOUT_S + 10  # failed, not hung


# ---------------------------------------------------------------------------- resuming at another world size
def _tiny_run(model: nn.Module):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=generator),
                         torch.randint(0, 3, (64,), generator=generator))
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 DataLoader(data, batch_size=16), noise_multiplier=1.0, target_delta=1e-3,
                                 steps=4, seed=SEED)


def _tiny_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _steps(engine, count: int) -> None:
    batches = iter(engine.data_loader)
    for _ in range(count):
        x, y = next(batches)
        engine.optimizer.zero_grad()
        if len(y):
            F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()


def _resume_scenario(rank: int, port: int, out: str) -> None:
    _join_group(rank, port)
    saved = torch.load(Path(out) / "one_process.pt", weights_only=False)
    model = _tiny_model()
    model.load_state_dict(saved["weights"])
    engine = _tiny_run(DistributedDataParallel(model))
    engine.optimizer.load_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    _steps(engine, 2)
    torch.save({"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                "ledger": engine.ledger.state_dict()}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_one_process_checkpoint_resumes_in_two_ranks_as_the_same_run(tmp_path):
    """The sampler re-partitions exactly (step t's union batch does not depend on the world size), so a
    checkpoint resumes at another world size and continues the same run: same batches, same noise."""
    model = _tiny_model()
    single = _tiny_run(model)
    _steps(single, 2)
    torch.save({"weights": model.state_dict(), "optimizer": single.optimizer.state_dict(),
                "engine": single.state_dict()}, tmp_path / "one_process.pt")
    for process in _spawn(_resume_scenario, tmp_path):
        assert process.exitcode == 0
    _steps(single, 2)
    for rank in range(WORLD):
        resumed = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert resumed["ledger"] == single.ledger.state_dict()
        for name, weight in model.named_parameters():
            torch.testing.assert_close(resumed["weights"][name], weight.detach(), rtol=0, atol=1e-5)
