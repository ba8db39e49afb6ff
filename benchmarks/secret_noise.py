"""Secret vs seeded noise on a CPU: the generators' throughput, and the private step with each.

    OMP_NUM_THREADS=1 python benchmarks/secret_noise.py [--rounds 7] [--steps 8] [--only throughput|steps]
        [--compiled]

Throughput (one thread, a draw of 2²⁴ values per round, rounds interleaved): torch.randn (the seeded
path), 0.1's secret path (os.urandom + Box–Muller in float64), OpenSSL's ChaCha20 keystream, the secret
source's Gaussians (float32, float64) and Poisson decisions; ``--compiled`` adds the ChaCha20 block
function written in torch integer ops and compiled by ``torch.compile`` (inductor's C++; minutes to
compile). Steps: a 16.8M-parameter MLP (batch 64) and the digits MLP (batch 256), seeded and secret
engines built alike, their steps alternated; wall and process-CPU milliseconds, medians and ranges.
``--only steps`` runs with any tunefree version (it uses make_private only), for a before/after.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree

COUNT = 1 << 24


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


def _old_secret_normals(count: int) -> torch.Tensor:
    """0.1's secret path (privacy/randomness.py at 1725c10): 53-bit uniforms from os.urandom, Box–Muller
    in float64, both outputs used, cast to float32."""
    half = (count + 1) // 2
    raw = np.frombuffer(os.urandom(16 * half), dtype=np.uint64) >> np.uint64(11)
    uniform = torch.from_numpy((raw.astype(np.float64) + 0.5) / float(2**53))
    radius = uniform[:half].log_().mul_(-2).sqrt_()
    angle = uniform[half:].mul_(2 * math.pi)
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count].to(torch.float32)


def _openssl_keystream(count_bytes: int) -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    chunk = 1 << 19
    zeros, buffer = memoryview(bytes(chunk)), bytearray(chunk)
    cipher = Cipher(algorithms.ChaCha20(os.urandom(32), bytes(16)), mode=None).encryptor()
    for _ in range(count_bytes // chunk):
        cipher.update_into(zeros, buffer)


def _compiled_keystream() -> tuple[Callable[[int], torch.Tensor], float]:
    """The block function over int64 lanes (32-bit words, masked), compiled; and its compile seconds."""
    mask = 0xFFFFFFFF

    def rotl(x, n):
        return ((x << n) | (x >> (32 - n))) & mask

    def quarter(x, a, b, c, d):
        x[a] = (x[a] + x[b]) & mask
        x[d] = rotl(x[d] ^ x[a], 16)
        x[c] = (x[c] + x[d]) & mask
        x[b] = rotl(x[b] ^ x[c], 12)
        x[a] = (x[a] + x[b]) & mask
        x[d] = rotl(x[d] ^ x[a], 8)
        x[c] = (x[c] + x[d]) & mask
        x[b] = rotl(x[b] ^ x[c], 7)

    def blocks(state: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        s = [state[i].expand_as(counter) for i in range(16)]
        s[12] = (counter + state[12]) & mask
        x = list(s)
        for _ in range(10):
            for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                               (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
                quarter(x, a, b, c, d)
        return torch.stack([(x[i] + s[i]) & mask for i in range(16)], -1)

    compiled = torch.compile(blocks, dynamic=True)
    state = torch.tensor([*range(16)], dtype=torch.int64)
    start = time.perf_counter()
    compiled(state, torch.arange(64, dtype=torch.int64))
    return (lambda n: compiled(state, torch.arange(n // 64, dtype=torch.int64))), time.perf_counter() - start


def throughput(rounds: int, compiled: bool) -> None:
    from tunefree.privacy.chacha20 import ChaCha20Generator

    generator, cpu = ChaCha20Generator(), torch.device("cpu")
    # name: (run one draw, values per draw, bytes of random bits or output per draw, what the bytes are)
    methods: dict[str, tuple[Callable[[], object], int, int, str]] = {
        "torch.randn float32 (seeded runs)": (lambda: torch.randn(COUNT), COUNT, 4 * COUNT, "output"),
        "torch.randn float64": (lambda: torch.randn(COUNT, dtype=torch.float64), COUNT, 8 * COUNT, "output"),
        "os.urandom": (lambda: os.urandom(8 * COUNT), COUNT, 8 * COUNT, "random bytes"),
        "0.1 secret: os.urandom + Box–Muller f64 → f32": (lambda: _old_secret_normals(COUNT), COUNT,
                                                             8 * COUNT, "random bytes"),
        "OpenSSL ChaCha20 keystream (cryptography)": (lambda: _openssl_keystream(8 * COUNT), COUNT,
                                                      8 * COUNT, "keystream"),
        "secret source: ChaCha20 Gaussians float32": (lambda: generator.normals(COUNT, cpu, torch.float32),
                                                      COUNT, 6 * COUNT, "keystream"),
        "secret source: ChaCha20 Gaussians float64": (lambda: generator.normals(COUNT, cpu, torch.float64),
                                                      COUNT, 8 * COUNT, "keystream"),
        "secret source: Poisson decisions": (lambda: generator.bernoulli(COUNT, 0.01), COUNT, 8 * COUNT,
                                             "keystream"),
    }
    if compiled:
        draw, seconds = _compiled_keystream()
        print(f"torch.compile of the int64 block function: {seconds:.0f} s to compile")
        methods["torch.compile ChaCha20 keystream (int64 ops, C++)"] = (lambda: draw(8 * COUNT), COUNT,
                                                                         8 * COUNT, "keystream")
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, (run, _, _, _) in methods.items():
            start = time.process_time()
            run()
            seconds[name].append(time.process_time() - start)
    print(f"\nthroughput, {torch.get_num_threads()} thread(s), {COUNT} values per draw, {rounds} rounds "
          "(process CPU time; median [range])\n")
    print("| method | values/s (millions) | GB/s | bytes counted |\n|---|---|---|---|")
    for name, (_, values, size, what) in methods.items():
        rates = [values / s / 1e6 for s in seconds[name]]
        gbs = [size / s / 1e9 for s in seconds[name]]
        print(f"| {name} | {_median_range(rates)} | {_median_range(gbs)} | {what} |")


def mlp_16m() -> nn.Module:
    """16,796,682 parameters: 512 → 4096 → 2048 → 2048 → 1024 → 10."""
    widths = (512, 4096, 2048, 2048, 1024)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _engine(model_fn: Callable[[], nn.Module], features: int, examples: int, batch: int, seed: int | None):
    torch.manual_seed(0)
    model = model_fn()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(examples, features, generator=g), torch.randint(0, 10, (examples,),
                                                                                      generator=g))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                   DataLoader(data, batch_size=batch), noise_multiplier=1.0,
                                   target_delta=1e-5, seed=seed)
    batches = iter(engine.data_loader)

    def step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(engine.data_loader)
            x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()

    return step


def steps(rounds: int, steps_per_round: int) -> None:
    models = {"MLP 16.8M, batch 64": (mlp_16m, 512, 6400, 64),
              "digits MLP 26k, batch 256": (digits_mlp, 64, 1797, 256)}
    print(f"\nprivate steps, {torch.get_num_threads()} thread(s), {rounds}×{steps_per_round} steps of each, "
          "alternated (ms; median [range])\n")
    print("| model | seeded wall | secret wall | ratio | seeded CPU | secret CPU | ratio |\n"
          "|---|---|---|---|---|---|---|")
    for name, (model_fn, features, examples, batch) in models.items():
        runs = {kind: _engine(model_fn, features, examples, batch, seed) for kind, seed in
                (("seeded", 0), ("secret", None))}
        wall: dict[str, list[float]] = {kind: [] for kind in runs}
        cpu: dict[str, list[float]] = {kind: [] for kind in runs}
        for run in runs.values():
            run(), run()  # warm-up
        for _ in range(rounds * steps_per_round):
            for kind, run in runs.items():
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                run()
                wall[kind].append(1000 * (time.perf_counter() - start_wall))
                cpu[kind].append(1000 * (time.process_time() - start_cpu))
        cells = []
        for clock in (wall, cpu):
            ratio = statistics.median(clock["secret"]) / statistics.median(clock["seeded"])
            cells += [_median_range(clock["seeded"]), _median_range(clock["secret"]), f"{ratio:.3f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps of each kind per round")
    parser.add_argument("--only", choices=("throughput", "steps"))
    parser.add_argument("--compiled", action="store_true", help="also time a torch.compile'd keystream")
    args = parser.parse_args()
    if args.only != "steps":
        throughput(args.rounds, args.compiled)
    if args.only != "throughput":
        steps(args.rounds, args.steps)


if __name__ == "__main__":
    main()
