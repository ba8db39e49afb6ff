"""Peak memory of one training step of a GPT-2-shaped model on the CPU: non-private, tunefree all-layer and
per-layer, in float32 or under bfloat16 autocast, each in a fresh process.

The model is Hugging Face's ``GPT2LMHeadModel`` (tied input and output embeddings, dropouts 0) with
``--layers`` blocks; a step is forward, backward and ``optimizer.step()`` (AdamW; private runs: seeded
noise, ``poisson_sampling=False``). The peak is the RSS high-water mark of one step after a warm-up
step, with glibc's large blocks mmapped (``MALLOC_MMAP_THRESHOLD_``, set for the children) so that
freed tensors leave the RSS; "training" is the peak less the RSS once the libraries are imported.
bfloat16 runs sum the per-example losses (``loss_reduction="sum"``: a mean of 16-bit gradients is
refused, docs/refusals.md), and so does their non-private reference.

    OMP_NUM_THREADS=1 python benchmarks/step_memory.py --layers 2 --tokens 128
    OMP_NUM_THREADS=1 python benchmarks/step_memory.py --dtypes bf16 --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODES = ("non-private", "all-layer", "per-layer")


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def child(mode: str, dtype: str, layers: int, batch: int, tokens: int) -> dict:
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    import tunefree

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    libraries = _rss_mb("VmRSS")
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=tokens, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0))
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))
    positions = torch.arange(tokens).expand(batch, tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reduction = "sum" if dtype == "bf16" else "mean"
    if mode != "non-private":
        optimizer = tunefree.make_private(
            model, optimizer, DataLoader(TensorDataset(ids), batch_size=batch), noise_multiplier=1.0,
            target_delta=1e-3, groups=mode, seed=0, poisson_sampling=False,
            loss_reduction=reduction).optimizer
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        optimizer.zero_grad()
        with autocast:
            logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction=reduction)
        loss.backward()
        optimizer.step()

    step()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    step()
    peak = _rss_mb("VmHWM")
    return {"peak_mb": peak, "training_mb": peak - libraries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--baseline-src", default=None,
                        help="another checkout's src: its private modes are measured too ('before')")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.layers, args.batch, args.tokens)))
        return
    sources = [("after", None)] + ([("before", args.baseline_src)] if args.baseline_src else [])
    rows = []
    for dtype in args.dtypes:
        for mode in args.modes:
            for label, src in sources:
                if mode == "non-private" and label == "before":
                    continue
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
                if src is not None:
                    env["PYTHONPATH"] = src
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, dtype, "--layers", str(args.layers),
                     "--batch", str(args.batch), "--tokens", str(args.tokens)],
                    capture_output=True, text=True, env=env, check=False)
                if out.returncode != 0:
                    print(f"{mode} {dtype} {label} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                result = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append((dtype, mode, label, result))
                print(f"{dtype} {mode:12s} {label:6s} peak {result['peak_mb']:8.0f} MB, training "
                      f"{result['training_mb']:8.0f} MB", file=sys.stderr, flush=True)
    base = {dtype: r for dtype, mode, _, r in rows if mode == "non-private"}
    print(f"GPT-2 shape, {args.layers} blocks, batch {args.batch} × {args.tokens} tokens, 1 thread\n")
    print("| dtype | mode | code | peak RSS | training | × non-private (peak / training) |")
    print("|---|---|---|---|---|---|")
    for dtype, mode, label, r in rows:
        ref = base.get(dtype)
        ratio = (f"{r['peak_mb'] / ref['peak_mb']:.2f} / {r['training_mb'] / ref['training_mb']:.2f}"
                 if ref else "")
        print(f"| {dtype} | {mode} | {label if mode != 'non-private' else ''} | {r['peak_mb']:.0f} MB | "
              f"{r['training_mb']:.0f} MB | {ratio} |")


if __name__ == "__main__":
    main()
