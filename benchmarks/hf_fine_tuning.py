"""Private fine-tuning of transformers: step time and peak memory of tunefree and Opacus against
non-private training, on BERT-base-shaped and GPT-2-small-shaped random-init models, full fine-tuning
and LoRA.

The shapes are those of the base models (hidden 768, 12 heads, MLP 3072, their vocabularies and position
tables); ``--layers`` sets the depth (12 for the real shapes; fewer on a CPU). BERT is a sequence
classifier (cross-entropy of 2 classes), GPT-2 a causal LM (mean next-token loss of each example, the
batch mean of those). LoRA: peft rank 8 on the attention projections (BERT query/value, GPT-2 c_attn),
the base frozen. Every method gets the same inputs, including explicit (B, L) position and token type
ids, which Opacus needs (tunefree does not). A step is forward + backward + AdamW step on one fixed
batch; for the private methods clipping, noise and the privacy record are included.

Each (model, method) measurement runs in a fresh subprocess, methods interleaved round by round (order
reversed every other round) so that machine noise hits all alike; the table gives medians over rounds.
Peak memory: on CUDA the allocator's peak during the steps; on CPU the RSS high-water mark
(``/proc/self/clear_refs`` reset after the imports) minus the RSS then — weights, optimizer state,
activations, gradients and per-example work, with the libraries' pages cancelled out.

    python benchmarks/hf_fine_tuning.py --layers 2 --seq 128 --batch 8 --threads 1 --rounds 2
    python benchmarks/hf_fine_tuning.py --device cuda --layers 12 --seq 256 --batch 32
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the package it measures: keep its directory off the import path.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

MODELS = ("bert-base", "gpt2-small")
MODES = ("full", "lora")
METHODS = ("non-private", "tunefree", "opacus")
LORA_TARGETS = {"bert-base": ["query", "value"], "gpt2-small": ["c_attn"]}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def build(name: str, mode: str, layers: int, seq: int, batch: int, device: str):
    """The model (train mode, on ``device``), its inputs and its per-example loss function."""
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    if name == "bert-base":
        config = transformers.BertConfig(num_hidden_layers=layers, num_labels=2)
        model = transformers.BertForSequenceClassification(config)
        targets = torch.randint(0, 2, (batch,))
    else:
        config = transformers.GPT2Config(n_layer=layers)
        model = transformers.GPT2LMHeadModel(config)
        targets = None
    if mode == "lora":
        task = peft.TaskType.SEQ_CLS if name == "bert-base" else peft.TaskType.CAUSAL_LM
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[name], task_type=task))
    model = model.to(device).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(seq, device=device).repeat(batch, 1)}
    if name == "bert-base":
        inputs["token_type_ids"] = torch.zeros_like(ids)
        targets = targets.to(device)

        def losses(output):
            return F.cross_entropy(output.logits, targets, reduction="none")
    else:
        def losses(output):
            logits = output.logits[:, :-1]
            return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    return model, inputs, losses


def make_step(method: str, model, inputs, losses, batch: int):
    """One training step of ``method`` on the fixed batch."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loader = DataLoader(TensorDataset(torch.zeros(batch, 1)), batch_size=batch)
    if method == "non-private":
        run_model, run_optimizer = model, optimizer
    elif method == "tunefree":
        import tunefree

        engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0, target_delta=1e-5,
                                       clipping="auto-s", seed=0, poisson_sampling=False)
        run_model, run_optimizer = model, engine.optimizer
    else:
        import warnings

        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        run_model, run_optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks")

    def step():
        run_optimizer.zero_grad()
        losses(run_model(**inputs)).mean().backward()
        run_optimizer.step()
    return step


def child(name: str, mode: str, method: str, args: argparse.Namespace) -> dict:
    import peft  # noqa: F401 - imported before the baseline, like every library
    import torch
    import transformers  # noqa: F401

    if method == "tunefree":
        import tunefree  # noqa: F401
    elif method == "opacus":
        import opacus  # noqa: F401
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    before = _rss_kb("VmRSS")
    model, inputs, losses = build(name, mode, args.layers, args.seq, args.batch, args.device)
    step = make_step(method, model, inputs, losses, args.batch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if cuda
               else (_rss_kb("VmHWM") - before) / 1024)
    return {"step_ms": 1000 * statistics.median(times), "peak_mb": peak_mb}


def run(args: argparse.Namespace) -> dict:
    cases = [(m, mode) for m in args.models for mode in args.modes]
    results: dict = {case: {method: [] for method in METHODS} for case in cases}
    flags = ["--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch),
             "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--device", args.device]
    for r in range(args.rounds):
        for case in cases:
            for method in METHODS if r % 2 == 0 else reversed(METHODS):
                out = subprocess.run([sys.executable, __file__, "--child", *case, method, *flags],
                                     capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    error = next((line for line in reversed(out.stderr.strip().splitlines())
                                  if "Error" in line or "error" in line), out.stderr.strip()[-300:])
                    results[case][method].append({"failed": error[:300]})
                    print(f"round {r + 1} {case} {method} failed: {error[:300]}", file=sys.stderr, flush=True)
                    continue
                measurement = json.loads(out.stdout.strip().splitlines()[-1])
                results[case][method].append(measurement)
                print(f"round {r + 1} {case[0]:10s} {case[1]:4s} {method:11s} "
                      f"{measurement['step_ms']:9.1f} ms {measurement['peak_mb']:8.1f} MB",
                      file=sys.stderr, flush=True)
    return results


def table(results: dict) -> str:
    lines = ["| model | fine-tuning | method | step time | × non-private (min–max) | peak memory | "
             "× non-private (min–max) |", "|---|---|---|---|---|---|---|"]
    for (name, mode), by_method in results.items():
        base = by_method["non-private"]
        for method, runs in by_method.items():
            pairs = [(m, b) for m, b in zip(runs, base) if "step_ms" in m and "step_ms" in b]
            if not pairs:
                failure = next((m["failed"] for m in runs if "failed" in m), "no measurement")
                lines.append(f"| {name} | {mode} | {method} | refused/failed: {failure} | | | |")
                continue
            t_ratio = [m["step_ms"] / b["step_ms"] for m, b in pairs]
            m_ratio = [m["peak_mb"] / b["peak_mb"] for m, b in pairs]
            step_ms = statistics.median(m["step_ms"] for m, _ in pairs)
            lines.append(
                f"| {name} | {mode} | {method} | {step_ms:.0f} ms | "
                f"{statistics.median(t_ratio):.2f} ({min(t_ratio):.2f}–{max(t_ratio):.2f}) | "
                f"{statistics.median(m['peak_mb'] for m, _ in pairs):.0f} MB | "
                f"{statistics.median(m_ratio):.2f} ({min(m_ratio):.2f}–{max(m_ratio):.2f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12: the base shapes)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per example")
    parser.add_argument("--batch", type=int, default=32, help="examples per step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the raw measurements here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps({" / ".join(k): v for k, v in results.items()}, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
