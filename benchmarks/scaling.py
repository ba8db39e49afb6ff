"""How private step time and peak memory grow with batch size, sequence length and vocabulary.

A small causal transformer (``models.GPT``: d 64, 2 heads, 1 block, untied head) is trained for a few steps
on one synthetic batch, non-private and with tunefree's all-layer and per-layer clipping, each point in a
fresh subprocess (the timing and memory meter of ``engine_overhead.py``). Three sweeps, one knob each:
batch size (T 128, V 5k), sequence length T 128 → 2048 (B 4, V 5k) and vocabulary V 5k → 50k (B 4, T 128).

Each linear layer takes the ghost norm (cost ~T²·(d_in + d_out) per example) or materialises its
per-sample gradient (~T·d_in·d_out), whichever the engine measured faster on the first step (the cost
formula where the estimates are far apart). The ``crossover`` sweep times both on one linear layer across
T, with the formula's and the measured pick, so that the T² term of the ghost norm and the choice are
visible.

    python benchmarks/scaling.py --plot /tmp/scaling.png            # writes the PNG, prints the tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CONFIGS = ("non-private", "tunefree all-layer", "tunefree per-layer")
DEFAULT = {"batch": 4, "length": 128, "vocab": 5000}
SWEEPS = {
    "batch": [4, 8, 16, 32],
    "length": [128, 256, 512, 1024, 2048],
    "vocab": [5000, 10000, 20000, 50000],
}
WIDTH, HEADS, LAYERS = 64, 2, 1


def child(config: str, batch: int, length: int, vocab: int, steps: int, threads: int) -> dict:
    """One point: median step time (ms) and peak training memory (MB) of ``config``."""
    import torch
    from engine_overhead import _make_step, _Meter
    from models import GPT, lm_loss

    torch.set_num_threads(threads)
    if config.startswith("tunefree"):
        import tunefree  # noqa: F401 - its pages do not count as training memory
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    meter = _Meter("cpu")
    meter.reset()
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=WIDTH, heads=HEADS, layers=LAYERS, context=length)
    step = _make_step(config, model, ids, targets, lm_loss)
    step()  # warm-up
    times = [meter.time(step) for _ in range(steps)]
    return {"step_ms": 1000 * statistics.median(times), "peak_mb": meter.peak_mb()}


def crossover(lengths: list[int], d_in: int, d_out: int, batch: int, repeats: int) -> list[dict]:
    """Time of the ghost norm and of the materialised per-sample norm of one linear layer, per T,
    the path the cost formula takes and the path the engine's ``PathChooser`` measures faster (timed
    at every T here, however far apart the estimates)."""
    import torch

    from tunefree.rules.factored import FactoredGrad, ghost_is_cheaper
    from tunefree.rules.paths import GHOST, MATERIALISE, PathChooser

    rows = []
    for length in lengths:
        a = torch.randn(batch, 1, length, d_in)
        b = torch.randn(batch, 1, length, d_out)
        grad = FactoredGrad(a, b, torch.Size([d_out, d_in]))
        timings = {}
        for name, path in (("ghost_ms", GHOST), ("materialised_ms", MATERIALISE)):
            grad.sq_norms_by(path)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                grad.sq_norms_by(path)
                samples.append(time.perf_counter() - start)
            timings[name] = 1000 * min(samples)
        grad.chooser = PathChooser(min_cost=0, max_ratio=float("inf"))
        grad.sq_norms()
        measured = next(iter(grad.chooser.choices.values()))
        rows.append({"length": length, **timings,
                     "rule": "ghost" if ghost_is_cheaper(length, d_in, d_out) else "materialised",
                     "measured": "ghost" if measured == GHOST else "materialised"})
    return rows


def run_sweeps(sweeps: dict[str, list[int]], steps: int, threads: int) -> dict:
    results: dict = {}
    for knob, values in sweeps.items():
        results[knob] = []
        for value in values:
            point = {**DEFAULT, knob: value}
            row = {knob: value}
            for config in CONFIGS:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", config, str(point["batch"]), str(point["length"]),
                     str(point["vocab"]), "--steps", str(steps), "--threads", str(threads)],
                    capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    print(f"{knob}={value} {config} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    row[config] = None
                    continue
                row[config] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{knob}={value:6d} {config:20s} {row[config]['step_ms']:9.1f} ms "
                      f"{row[config]['peak_mb']:8.1f} MB", file=sys.stderr, flush=True)
            results[knob].append(row)
    return results


def tables(results: dict, cross: list[dict]) -> str:
    lines = []
    for knob, rows in results.items():
        lines += [f"\n{knob} (others at {', '.join(f'{k} {v}' for k, v in DEFAULT.items() if k != knob)})",
                  f"| {knob} | non-private | all-layer (× time, × memory) | per-layer (× time, × memory) |",
                  "|---|---|---|---|"]
        for row in rows:
            base = row["non-private"]
            cells = [f"{base['step_ms']:.0f} ms, {base['peak_mb']:.0f} MB" if base else "failed"]
            for config in CONFIGS[1:]:
                m = row[config]
                cells.append(f"{m['step_ms']:.0f} ms, {m['peak_mb']:.0f} MB "
                             f"({m['step_ms'] / base['step_ms']:.2f}×, {m['peak_mb'] / base['peak_mb']:.2f}×)"
                             if m and base else "failed")
            lines.append(f"| {row[knob]} | " + " | ".join(cells) + " |")
    lines += ["\nper-sample norm of one linear layer (time, ms): ghost vs materialised, the formula's pick"
              " and the measured pick (PathChooser)",
              "| T | ghost | materialised | formula | measured |", "|---|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['ghost_ms']:.2f} | {r['materialised_ms']:.2f} | {r['rule']} | "
              f"{r['measured']} |" for r in cross]
    return "\n".join(lines)


def plot(results: dict, cross: list[dict], path: str, cross_shape: tuple[int, int, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for col, (knob, rows) in enumerate(results.items()):
        xs = [row[knob] for row in rows]
        for config in CONFIGS:
            for r, key in enumerate(("step_ms", "peak_mb")):
                ys = [row[config][key] if row[config] else float("nan") for row in rows]
                axes[r][col].plot(xs, ys, marker="o", label=config)
        for r, label in enumerate(("step time (ms)", "peak memory (MB)")):
            axes[r][col].set(xscale="log", yscale="log", xlabel=knob, ylabel=label)
            axes[r][col].legend(fontsize=7)
    ts = [r["length"] for r in cross]
    ax = axes[0][3]
    ax.plot(ts, [r["ghost_ms"] for r in cross], marker="o", label="ghost norm (T²)")
    ax.plot(ts, [r["materialised_ms"] for r in cross], marker="o", label="materialised (T)")
    for r in cross:
        ax.annotate(r["rule"][0], (r["length"], min(r["ghost_ms"], r["materialised_ms"])), fontsize=7)
    batch, d_in, d_out = cross_shape
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="per-sample norm time (ms)",
           title=f"one linear {d_in}→{d_out}, B {batch} (letter: rule's pick)")
    ax.legend(fontsize=7)
    axes[1][3].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, metavar=("CONFIG", "BATCH", "LENGTH", "VOCAB"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--plot", help="write the plots to this PNG file")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    for knob, values in SWEEPS.items():
        parser.add_argument(f"--{knob}", nargs="+", type=int, default=values, help=f"{knob} values to sweep")
    parser.add_argument("--cross-lengths", nargs="+", type=int,
                        default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    args = parser.parse_args()
    if args.child:
        config, batch, length, vocab = args.child
        print(json.dumps(child(config, int(batch), int(length), int(vocab), args.steps, args.threads)))
        return
    import torch

    torch.set_num_threads(args.threads)
    cross_shape = (4, WIDTH, WIDTH)
    cross = crossover(args.cross_lengths, WIDTH, WIDTH, batch=cross_shape[0], repeats=5)
    results = run_sweeps({knob: getattr(args, knob) for knob in SWEEPS}, args.steps, args.threads)
    print(tables(results, cross))
    if args.plot:
        plot(results, cross, args.plot, cross_shape)
        print(f"plots written to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
