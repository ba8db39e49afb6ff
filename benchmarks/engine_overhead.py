"""Step time and peak memory of private training, as ratios to non-private training in the same run.

Each (model, configuration) measurement runs in a fresh subprocess; configurations are interleaved
round by round so that machine noise hits all of them alike. A step is forward + backward + optimizer
step on one fixed synthetic batch (for private configurations: per-sample clipping, noise and the
ledger record included).

Peak memory: the child resets the kernel's RSS high-water mark (``/proc/self/clear_refs``) right
before building the model, and reports the high-water mark after the timed steps minus the RSS at that
moment — the memory training needs (weights, optimizer state, activations, gradients, per-sample work),
with interpreter and library pages cancelled out. With ``--device cuda``: the CUDA allocator's peak
(``torch.cuda.max_memory_allocated``) over the same span, and each step timed between two
``torch.cuda.synchronize()`` calls.

    python benchmarks/engine_overhead.py --rounds 3 --steps 10
    python benchmarks/engine_overhead.py --models digits-mlp --steps 200 --warmup 20   # the fixed tax
    python benchmarks/engine_overhead.py --device cuda --hf                              # on a GPU
    python benchmarks/engine_overhead.py --configs "tunefree per-layer" "baseline per-layer" \
        --baseline-src ../main/src                               # before/after in the same run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("non-private", "tunefree all-layer", "tunefree per-layer", "opacus hooks",
           "opacus ghost")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _make_step(config: str, model, x, y, loss_fn):
    """A function running one training step of ``config``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    if config == "non-private":
        def step():
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        return step
    if config.startswith("tunefree"):
        import tunefree

        groups = config.split()[1]
        engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0,
                                       target_delta=1e-5 if len(x) > 100 else 1e-3,
                                       clipping="auto-s", groups=groups, seed=0,
                                       poisson_sampling=False)

        def step():
            engine.optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            engine.optimizer.step()
        return step
    import warnings

    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    mode = config.split()[1]
    privacy = PrivacyEngine()
    if mode == "hooks":
        private_model, private_opt, _ = privacy.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks")

        def step():
            private_opt.zero_grad()
            loss_fn(private_model(x), y).backward()
            private_opt.step()
        return step

    class Criterion(torch.nn.Module):
        reduction = "mean"

        def forward(self, logits, targets):
            return loss_fn(logits, targets)

    private_model, private_opt, criterion, _ = privacy.make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=Criterion(),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
        grad_sample_mode="ghost")

    def step():
        private_opt.zero_grad()
        criterion(private_model(x), y).backward()
        private_opt.step()
    return step


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, before any child starts."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch sees no CUDA device on this machine "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                         "run on a GPU machine or drop --device")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise SystemExit(f"--device {device}: use cpu or cuda[:index]")


class _Meter:
    """Step time and training memory on the CPU (RSS high-water mark) or a CUDA device (allocator peak)."""

    def __init__(self, device: str, cpu_time: bool = False):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        # CPU seconds of the whole process (every thread) instead of wall time: on a shared, loaded
        # machine it leaves out the time spent waiting for a core
        self.clock = time.process_time if cpu_time else time.perf_counter

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.before = self.torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
            self.before = 1024 * _rss_kb("VmRSS")

    def time(self, step) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        start = self.clock()
        step()
        if self.cuda:
            self.torch.cuda.synchronize()
        return self.clock() - start

    def peak_mb(self) -> float:
        peak = self.torch.cuda.max_memory_allocated() if self.cuda else 1024 * _rss_kb("VmHWM")
        return (peak - self.before) / 2**20


def child(model_name: str, config: str, steps: int, warmup: int, threads: int, device: str = "cpu",
          cpu_time: bool = False) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from models import benchmark

    torch.set_num_threads(threads)
    # Libraries are imported before the baseline so that their pages do not count as training memory; so is
    # torch._dynamo, which torch.optim imports when the first optimizer is built (with torch.distributed's
    # tensor package and sympy, ~150 MB of RSS), inside the measured span otherwise.
    import torch._dynamo  # noqa: F401
    if config.startswith("tunefree"):
        import tunefree  # noqa: F401
    elif config.startswith("opacus"):
        import opacus  # noqa: F401
    torch.manual_seed(0)
    model_fn_inputs = benchmark(model_name)
    _, x, y, loss_fn = model_fn_inputs
    del model_fn_inputs
    x, y = x.to(device), y.to(device)
    meter = _Meter(device, cpu_time)
    meter.reset()
    torch.manual_seed(0)
    model = benchmark(model_name)[0].to(device)
    step = _make_step(config, model, x, y, loss_fn)
    for _ in range(warmup):
        step()
    times = [meter.time(step) for _ in range(steps)]
    return {"step_ms": 1000 * statistics.median(times), "peak_mb": meter.peak_mb()}


def available_configs() -> list[str]:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return [c for c in CONFIGS if not c.startswith("opacus")]
    return list(CONFIGS)


def _child_command(config: str, baseline_src: str | None) -> tuple[str, dict | None]:
    """The configuration a child runs and its environment: ``baseline …`` configurations run
    tunefree from ``baseline_src`` (another checkout's ``src``), the rest from this one."""
    if not config.startswith("baseline"):
        return config, None
    if baseline_src is None:
        raise SystemExit(f"configuration {config!r} needs --baseline-src (a tunefree src directory)")
    return config.replace("baseline", "tunefree", 1), {**os.environ, "PYTHONPATH": baseline_src}


def run(models: list[str], configs: list[str], rounds: int, steps: int, warmup: int,
        threads: int, device: str = "cpu", baseline_src: str | None = None, cpu_time: bool = False) -> dict:
    results: dict = {m: {c: [] for c in configs} for m in models}
    for r in range(rounds):
        for model_name in models:
            order = configs if r % 2 == 0 else list(reversed(configs))
            for config in order:
                child_config, env = _child_command(config, baseline_src)
                out = subprocess.run(
                    [sys.executable, __file__, "--child", model_name, child_config, "--steps", str(steps),
                     "--warmup", str(warmup), "--threads", str(threads), "--device", device,
                     *(["--cpu-time"] if cpu_time else [])],
                    capture_output=True, text=True, check=False, env=env)
                if out.returncode != 0:
                    print(f"{model_name} / {config} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    results[model_name][config].append(None)
                    continue
                measurement = json.loads(out.stdout.strip().splitlines()[-1])
                results[model_name][config].append(measurement)
                print(f"round {r + 1} {model_name:10s} {config:20s} {measurement['step_ms']:8.1f} ms "
                      f"{measurement['peak_mb']:8.1f} MB", file=sys.stderr, flush=True)
    return results


def table(results: dict) -> str:
    lines = ["| model | configuration | step time | × non-private (min–max) | peak memory | "
             "× non-private (min–max) |", "|---|---|---|---|---|---|"]
    for model_name, by_config in results.items():
        base = by_config["non-private"]
        for config, runs in by_config.items():
            pairs = [(m, b) for m, b in zip(runs, base) if m and b]
            if not pairs:
                lines.append(f"| {model_name} | {config} | failed | | | |")
                continue
            t_ratio = [m["step_ms"] / b["step_ms"] for m, b in pairs]
            m_ratio = [m["peak_mb"] / b["peak_mb"] for m, b in pairs]
            step_ms = statistics.median(m["step_ms"] for m, _ in pairs)
            peak = statistics.median(m["peak_mb"] for m, _ in pairs)
            lines.append(
                f"| {model_name} | {config} | {step_ms:.1f} ms | {statistics.median(t_ratio):.2f} "
                f"({min(t_ratio):.2f}–{max(t_ratio):.2f}) | {peak:.1f} MB | "
                f"{statistics.median(m_ratio):.2f} ({min(m_ratio):.2f}–{max(m_ratio):.2f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["digits-mlp", "mnist-cnn", "gpt", "resnet9"],
                        help="any of digits-mlp, mnist-cnn, gpt, resnet9, bert-tiny, gpt2-tiny")
    parser.add_argument("--hf", action="store_true",
                        help="also the tiny Hugging Face models bert-tiny and gpt2-tiny (needs transformers)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:index]")
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"subset of {', '.join(CONFIGS)}, or 'baseline all-layer' / "
                             "'baseline per-layer' (with --baseline-src); non-private is always included")
    parser.add_argument("--baseline-src", default=None,
                        help="with configurations 'baseline all-layer' / 'baseline per-layer': the src "
                             "directory of another tunefree checkout, measured in the same interleaved run")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps in CPU seconds of the process (all threads), not wall time: for a "
                             "loaded machine; CPU only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, args.threads, args.device,
                               args.cpu_time)))
        return
    check_device(args.device)
    configs = args.configs or available_configs()
    if "non-private" not in configs:
        configs = ["non-private", *configs]
    models = args.models + [m for m in ("bert-tiny", "gpt2-tiny") if args.hf and m not in args.models]
    results = run(models, configs, args.rounds, args.steps, args.warmup, args.threads, args.device,
                  args.baseline_src, args.cpu_time)
    print(table(results))


if __name__ == "__main__":
    main()
