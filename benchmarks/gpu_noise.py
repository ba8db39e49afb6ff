"""The secret source on a CUDA device: correct, one kernel per release, and its time against torch.randn.

    python benchmarks/gpu_noise.py [--json PATH] [--float64]      (on a machine with a CUDA GPU; < 2 min)
    python benchmarks/gpu_noise.py --device cpu                    (a smoke test of this script's code)

1. Correct: the kernel's keystream is RFC 8439 §2.3.2's block bit for bit, and its Gaussians equal the CPU
   path's (same key, same draw number) up to float32 rounding (``--float64``: float64 too; a second
   kernel to compile).
2. One kernel per release: ``torch.profiler`` lists the CUDA kernels of one ``SecretSource.normals`` call
   and of one gradient release of a 16.8M-parameter MLP (the noise kernel, then the foreach mul/add).
3. Time (CUDA events, median of 20 after warm-up): ``torch.randn`` against the secret source for 1M,
   16.8M and 124M float32 Gaussians, and 16.8M bfloat16.
4. A private step of the MLP (batch 256) on the GPU, seeded against secret, alternated: medians, ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.privacy.chacha20 import ChaCha20Generator
from tunefree.privacy.randomness import SecretSource

RFC_BLOCK = bytes.fromhex("10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
                          "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def mlp_16m() -> nn.Module:
    widths = (512, 4096, 2048, 2048, 1024)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def correctness(device: torch.device, float64: bool) -> dict:
    out: dict = {}
    if device.type == "cuda":
        from tunefree.privacy import chacha20_triton

        words = torch.zeros(1, 16, dtype=torch.int32, device=device)
        key = torch.frombuffer(bytearray(range(32)), dtype=torch.int32).to(device)
        nonce = struct.unpack("<3I", bytes.fromhex("000000090000004a00000000"))
        chacha20_triton.keystream(words, key, 1, nonce)
        out["rfc_8439_block_bit_for_bit"] = words.cpu().numpy().tobytes() == RFC_BLOCK
    for dtype in (torch.float32, torch.float64) if float64 else (torch.float32,):
        generator = ChaCha20Generator()
        on_device = generator.normals(1 << 20, device, dtype)  # draw number 0
        state = generator._state()
        draws, state.draws = state.draws, iter([0])  # the same draw number again, on the CPU
        on_cpu = generator.normals(1 << 20, torch.device("cpu"), dtype)
        state.draws = draws
        difference = (on_device.cpu() - on_cpu).abs().max().item()
        out[f"max |gpu - cpu| {dtype}"] = difference
    return out


def kernels_per_release(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    source = SecretSource()
    model = mlp_16m().to(device)
    shapes = [p.shape for p in model.parameters()]
    source.normals(shapes, device, torch.float32)  # compile first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        source.normals(shapes, device, torch.float32)
        torch.cuda.synchronize()
    draw = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    from tunefree.clipping.groups import make_groups
    from tunefree.privacy.mechanisms import GradientRelease

    release = GradientRelease(make_groups(model, "all-layer", 1.0), 1.0, source)
    sums = {p: torch.zeros_like(p) for p in model.parameters()}
    release.release(sums, {"all": 1.0})
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        release.release(sums, {"all": 1.0})
        torch.cuda.synchronize()
    whole = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return {"kernels of one normals() draw over 10 tensors": draw, "kernels of one gradient release": whole}


def speed(device: torch.device) -> list[dict]:
    source, rows = SecretSource(), []
    for count, dtype in ((1 << 20, torch.float32), (16_796_682, torch.float32), (124_000_000, torch.float32),
                         (16_796_682, torch.bfloat16)):
        if device.type != "cuda" and count > 20_000_000:
            continue
        shape = [torch.Size([count])]
        randn = timed(lambda: torch.randn(count, device=device, dtype=dtype), device)  # noqa: B023
        secret = timed(lambda: source.normals(shape, device, dtype), device)  # noqa: B023
        rows.append({"count": count, "dtype": str(dtype), "torch.randn ms": randn, "secret ms": secret,
                     "ratio": secret / randn})
    return rows


def steps(device: torch.device, count: int = 20) -> dict:
    runs = {}
    for kind, seed in (("seeded", 0), ("secret", None)):
        torch.manual_seed(0)
        model = mlp_16m().to(device)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.rand(25600, 512, generator=g), torch.randint(0, 10, (25600,), generator=g))
        engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                       DataLoader(data, batch_size=256), noise_multiplier=1.0,
                                       target_delta=1e-5, seed=seed)
        batches = iter(engine.data_loader)

        def step(engine=engine, model=model, batches=batches) -> None:
            x, y = next(batches)
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            engine.optimizer.step()

        runs[kind] = step
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for _ in range(3):
        for run in runs.values():
            run()
    for _ in range(count):
        for kind, run in runs.items():
            times[kind].append(timed(run, device, repeats=1, warmup=0))
    medians = {kind: statistics.median(t) for kind, t in times.items()}
    return {**{f"{kind} step ms": m for kind, m in medians.items()},
            "ratio": medians["secret"] / medians["seeded"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--float64", action="store_true", help="also check float64 (a second compile)")
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    result["correctness"] = correctness(device, args.float64)
    result["kernels"] = kernels_per_release(device)
    result["speed"] = speed(device)
    result["steps"] = steps(device, 20 if device.type == "cuda" else 3)
    result["seconds"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))
    print("\n| Gaussians | dtype | torch.randn ms | secret ms | ratio |\n|---|---|---|---|---|")
    for row in result["speed"]:
        print(f"| {row['count']:,} | {row['dtype']} | {row['torch.randn ms']:.3f} | {row['secret ms']:.3f} | "
              f"{row['ratio']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
