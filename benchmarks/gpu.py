"""Issue 24's table on one GPU: tunefree (all-layer and per-layer, seeded and secret noise) and Opacus (hooks,
ghost) against non-private training, side by side, with a float64 zero-noise exactness check per model.

Each (model, method) runs in a fresh process: AdamW steps on one fixed synthetic batch, the median step
time after warm-up (each step between two ``torch.cuda.synchronize()``) and the peak memory of the whole
child (CUDA: ``torch.cuda.max_memory_allocated``, weights and optimizer state included; CPU: the RSS
high-water mark above the RSS before the model is built). A method that fails (Opacus under autocast, on
in-place ReLU, …) is reported as failed with its error, not left out. Each model's exactness check is one
more process: the model in float64 on the device, dropout off, 3 examples, noise multiplier 0, Abadi
clipping at the median per-example norm (some examples clipped, some not); the released gradient against a
batch-size-1 autograd loop, as ‖release − loop‖ / ‖loop‖ over all parameters.

Models are built from their configurations (nothing is downloaded): transformers' ``GPT2Config`` /
``BertConfig``, peft's LoRA, torchvision's ``resnet18`` (GroupNorm through ``norm_layer``) and ``vit_b_16``
(``weights=None``). A row whose package is missing says so ("torchvision not installed"); so does Opacus.
``--tiny`` builds the same architectures at toy sizes, for ``--device cpu`` smoke runs (the test suite runs
one).

On a GPU session's machine (python3 with CUDA torch, transformers, peft, torchvision, numpy, scipy, attrs,
absl-py, mpmath, wrapt and opt-einsum already there: ``GPU_IMAGE``; nothing can be fetched there), carry
the missing packages as wheels (``OFFLINE_WHEELS``: tunefree's accountant and its tree library, Opacus,
and ``cryptography`` with ``cffi`` and ``pycparser``, which ``import tunefree`` needs for the CPU's
ChaCha20; ``tests/test_gpu_benchmark.py`` checks the list against what ``import tunefree`` and a private
step import), made here::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \\
        dp-accounting==0.6.0 dm-tree==0.1.10 opacus==1.6.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12

then run there (carry ``.whl``; ``--time-limit``, 330 s by default, stops starting children after it and
reports them skipped, so the run ends within about 6 minutes — not yet timed on a GPU)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src python3 benchmarks/gpu.py --device cuda --json $OUT/gpu.json > $OUT/gpu.md

``benchmarks/gpu_session.sh`` does both, and the noise kernel's checks, in one command.

Elsewhere: ``pip install -e .[hf,bench]`` and ``pip install --no-deps "torchvision==0.28.*"`` (the release
paired with torch 2.13; PyPI's CPU-only torchvision does not import beside the pinned CPU torch here).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODELS = ("gpt2-small", "gpt2-small-bf16", "gpt2-medium-bf16", "bert-base", "resnet18-gn", "vit-b16",
          "gpt2-lora")
EXTRA_MODELS = ("gpt2-small-1024",)  # the long-sequence row, on request
METHODS = ("non-private", "tunefree-all-seeded", "tunefree-per-seeded", "tunefree-all-secret",
           "tunefree-per-secret", "opacus-hooks", "opacus-ghost")
CHECKS = ("exactness", "clip-bound")  # per model, after the methods (--no-exactness skips them)
# The offline recipe (module docstring, docs/gpu.md): wheels to carry to a GPU machine, and the
# distributions its image already holds that tunefree or these wheels import.
OFFLINE_WHEELS = ("dp-accounting==0.6.0", "dm-tree==0.1.10", "opacus==1.6.0", "cryptography==50.0.2",
                  "cffi==2.1.1", "pycparser==3.12")
GPU_IMAGE = ("torch", "triton", "numpy", "scipy", "attrs", "absl-py", "mpmath", "wrapt", "opt-einsum",
             "typing-extensions", "transformers", "peft", "torchvision")
LABELS = {
    "gpt2-small": "GPT-2 small fp32, 16 × 256", "gpt2-small-bf16": "GPT-2 small bf16 autocast, 16 × 256",
    "gpt2-medium-bf16": "GPT-2 medium bf16 autocast, 8 × 512", "bert-base": "BERT-base fp32, 32 × 256",
    "resnet18-gn": "ResNet-18 (GroupNorm) 32×32, batch 256", "vit-b16": "ViT-B/16 224×224, batch 32",
    "gpt2-lora": "GPT-2 small + LoRA r = 8, 16 × 256", "gpt2-small-1024": "GPT-2 small fp32, 4 × 1024",
}


# ---------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A model, one synthetic batch and how to run it: ``inputs`` are the model call's keywords (or one
    positional tensor), ``task`` "lm" (next-token loss on the input ids) or "classify"."""

    model: Any
    inputs: Any
    targets: Any
    task: str
    autocast: Any = None  # torch dtype of the forward's autocast, or None
    batch: int = 0
    extra: dict = field(default_factory=dict)


class Missing(RuntimeError):
    """A package a row needs is not installed (reported in the table, not a failure)."""


def _need(package: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise Missing(f"{package.split('.')[0]} not installed") from error


def _gpt2_config(tiny: bool, layers: int = 12, width: int = 768, heads: int = 12, positions: int = 1024,
                 dropout: bool = True):
    transformers = _need("transformers")
    p = 0.1 if dropout else 0.0
    if tiny:
        layers, width, heads, positions = 2, 32, 2, 64
    return transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions,
                                   vocab_size=128 if tiny else 50257, resid_pdrop=p, embd_pdrop=p,
                                   attn_pdrop=p)


def build(name: str, tiny: bool, device: str, dtype=None, dropout: bool = True, batch: int | None = None,
          length: int | None = None, layers: int | None = None) -> Workload:
    """The workload of ``name`` (``--tiny``: the same architecture at toy size) on ``device``; ``dtype``,
    ``batch``, ``length`` (tokens) and ``layers`` (GPT-2's blocks) override the defaults (the exactness
    check: float64, 3 examples, 16 tokens)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sequence = {"gpt2-medium-bf16": 512, "gpt2-small-1024": 1024}.get(name, 256)
    examples = {"gpt2-medium-bf16": 8, "bert-base": 32, "resnet18-gn": 256, "vit-b16": 32,
                "gpt2-small-1024": 4}.get(name, 16)
    if tiny:
        sequence, examples = 16, 4
    sequence, examples = length or sequence, batch or examples
    autocast = torch.bfloat16 if name.endswith("-bf16") else None
    g = torch.Generator().manual_seed(1)

    def draw(factory, *args):  # the same batch on every device: drawn on the CPU, then moved
        return factory(*args, generator=g, device="cpu").to(device)

    def positions(rows: int, length: int):  # explicit (B, L) position ids: Opacus needs one row per example
        return torch.arange(length, device=device).expand(rows, -1).contiguous()
    with torch.device(device):
        if name.startswith("gpt2"):
            transformers = _need("transformers")
            medium = name.startswith("gpt2-medium")
            config = _gpt2_config(tiny, *((24, 1024, 16) if medium else ()), dropout=dropout)
            config.n_layer = layers or config.n_layer
            model = transformers.GPT2LMHeadModel(config)
            if name == "gpt2-lora":
                peft = _need("peft")
                lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                                       lora_dropout=0.0)
                model = peft.get_peft_model(model, lora)
            ids = draw(torch.randint, 0, config.vocab_size, (examples, sequence))
            workload = Workload(model, {"input_ids": ids, "position_ids": positions(examples, sequence)}, ids,
                                "lm", autocast)
        elif name == "bert-base":
            transformers = _need("transformers")
            p = 0.1 if dropout else 0.0
            shape = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                         vocab_size=128, max_position_embeddings=64) if tiny else {}
            config = transformers.BertConfig(num_labels=2, hidden_dropout_prob=p,
                                             attention_probs_dropout_prob=p, **shape)
            model = transformers.BertForSequenceClassification(config)
            ids = draw(torch.randint, 0, config.vocab_size, (examples, sequence))
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "token_type_ids": torch.zeros_like(ids), "position_ids": positions(examples, sequence)}
            workload = Workload(model, inputs, draw(torch.randint, 0, 2, (examples,)), "classify")
        elif name == "resnet18-gn":
            models = _need("torchvision.models")
            model = models.resnet18(num_classes=10, norm_layer=lambda channels: nn.GroupNorm(32, channels))
            images = draw(torch.randn, examples, 3, 32, 32)
            workload = Workload(model, images, draw(torch.randint, 0, 10, (examples,)), "classify")
        elif name == "vit-b16":
            vision = _need("torchvision.models.vision_transformer")
            size = 32 if tiny else 224
            model = (vision.VisionTransformer(size, 16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                                              num_classes=10) if tiny else
                     vision.vit_b_16(weights=None, num_classes=10))
            images = draw(torch.randn, examples, 3, size, size)
            workload = Workload(model, images, draw(torch.randint, 0, 10, (examples,)), "classify")
        else:
            raise SystemExit(f"unknown model {name!r}: use one of {', '.join(MODELS + EXTRA_MODELS)}")
    if dtype is not None:
        workload.model.to(dtype)
        if workload.task == "classify" and not isinstance(workload.inputs, dict):
            workload.inputs = workload.inputs.to(dtype)
    workload.model.train()
    workload.batch = examples
    return workload


def logits_of(workload: Workload, model) -> Any:
    out = model(**workload.inputs) if isinstance(workload.inputs, dict) else model(workload.inputs)
    return getattr(out, "logits", out)


def per_example_loss(task: str, logits, targets):
    """Each example's own loss, ``[B]``: the mean next-token loss over its tokens, or its class loss."""
    import torch
    import torch.nn.functional as F

    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if task == "lm":
        tokens = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), reduction="none")
        return tokens.view(targets.shape[0], -1).mean(1)
    return F.cross_entropy(logits, targets, reduction="none")


def _example_loss_module(task: str):
    """The loss as a module with a ``reduction`` (Opacus' ghost clipping asks it for per-example losses)."""
    from torch import nn

    class ExampleLoss(nn.Module):
        reduction = "mean"

        def forward(self, logits, targets):
            losses = per_example_loss(task, logits, targets)
            return losses if self.reduction == "none" else losses.mean()
    return ExampleLoss()


# ------------------------------------------------------------------------------------------------ methods
def _loader(batch: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.arange(100 * batch)), batch_size=batch)


def make_step(method: str, workload: Workload):
    """A function running one training step of ``method`` on the workload's batch."""
    import torch

    model = workload.model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    device_type = next(model.parameters()).device.type
    autocast = (torch.autocast(device_type, dtype=workload.autocast) if workload.autocast is not None
                else None)

    def loss_of(run_model, criterion=None, reduce=torch.mean):
        with autocast if autocast is not None else _nothing():
            logits = logits_of(workload, run_model)
            if criterion is not None:
                return criterion(logits, workload.targets)
            return reduce(per_example_loss(workload.task, logits, workload.targets))

    if method == "non-private":
        def step():
            optimizer.zero_grad()
            loss_of(model).backward()
            optimizer.step()
        return step
    if method.startswith("tunefree"):
        import tunefree

        _, groups, noise = method.split("-")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = tunefree.make_private(model, optimizer, _loader(workload.batch), target_delta=1e-5,
                                           noise_multiplier=1.0, groups=f"{groups}-layer",
                                           loss_reduction="sum",  # a 16-bit mean loss is refused (issue 21)
                                           seed=0 if noise == "seeded" else None, poisson_sampling=False)

        def step():
            engine.optimizer.zero_grad()
            loss_of(model, reduce=torch.sum).backward()
            engine.optimizer.step()
        return step
    opacus = _need("opacus")
    warnings.filterwarnings("ignore")
    privacy = opacus.PrivacyEngine()
    mode = method.split("-")[1]
    if mode == "hooks":
        private_model, private_optimizer, _ = privacy.make_private(
            module=model, optimizer=optimizer, data_loader=_loader(workload.batch), noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks")

        def step():
            private_optimizer.zero_grad()
            loss_of(private_model).backward()
            private_optimizer.step()
        return step
    private_model, private_optimizer, criterion, _ = privacy.make_private(
        module=model, optimizer=optimizer, data_loader=_loader(workload.batch),
        criterion=_example_loss_module(workload.task), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode="ghost")

    def step():
        private_optimizer.zero_grad()
        loss_of(private_model, criterion).backward()
        private_optimizer.step()
    return step


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------------- meters
def _rss_mb(field_name: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


class Meter:
    """Step time and peak memory: CUDA's allocator peak, or the CPU's RSS high-water mark above a baseline."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.before = 0.0
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
            self.before = _rss_mb("VmRSS")

    def time(self, step) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - start

    def peak_mb(self) -> float:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**20
        return _rss_mb("VmHWM") - self.before


# ------------------------------------------------------------------------------------------------- children
def measure(name: str, method: str, tiny: bool, device: str, steps: int, warmup: int,
            seconds: float, shape: dict | None = None) -> dict:
    """One (model, method): median step time over up to ``steps`` steps after ``warmup`` (fewer, but at
    least 3, when they would take longer than ``seconds``), and the peak memory."""
    import torch

    if method.startswith("tunefree"):
        import tunefree  # noqa: F401 - imported before the baseline, as Opacus and transformers are
    meter = Meter(device)
    workload = build(name, tiny, device, **(shape or {}))
    step = make_step(method, workload)
    for _ in range(warmup):
        step()
    times, start = [], time.perf_counter()
    while len(times) < steps and (len(times) < 3 or time.perf_counter() - start < seconds):
        times.append(meter.time(step))
    result = {"step_ms": 1000 * statistics.median(times), "steps": len(times), "peak_mb": meter.peak_mb(),
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    cuda = device.startswith("cuda")
    result["syncs_per_step"] = [synchronisations(step) for _ in range(3)] if cuda else None
    return result


def synchronisations(step) -> int:
    """How many times one call of ``step`` makes the host wait for the GPU (``torch.cuda``'s sync debug
    mode warns at each synchronising call: ``.item()``, ``.cpu()``, ``nonzero``, …)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def exactness(name: str, tiny: bool, device: str) -> dict:
    """The zero-noise release of tunefree (all-layer, Abadi clipping) against a float64 batch-size-1 loop,
    both on ``device``: ‖release − loop‖ / ‖loop‖ over all trainable parameters."""
    import copy

    import torch

    import tunefree

    workload = build(name, tiny, device, dtype=torch.float64, dropout=False, batch=3, length=16)
    model = workload.model
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    per_example = []
    for i in range(workload.batch):
        one = copy.copy(workload)
        one.inputs = ({k: v[i:i + 1] for k, v in workload.inputs.items()} if isinstance(workload.inputs, dict)
                      else workload.inputs[i:i + 1])
        one.targets = workload.targets[i:i + 1]
        loss = per_example_loss(workload.task, logits_of(one, reference), one.targets).mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        per_example.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    norms = torch.stack([torch.sqrt(sum((g * g).sum() for g in grads)) for grads in per_example])
    bound = float(norms.median())  # some examples clipped, some not
    expected = [sum(min(1.0, bound / float(n)) * grads[j] for n, grads in zip(norms, per_example))
                for j in range(len(params))]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = tunefree.make_private(model, optimizer, _loader(workload.batch), target_delta=1e-5,
                                       noise_multiplier=0.0, clipping="abadi", max_grad_norm=bound,
                                       groups="all-layer", seed=0, poisson_sampling=False)
    per_example_loss(workload.task, logits_of(workload, model), workload.targets).mean().backward()
    engine.optimizer.step()
    scale = engine.optimizer.expected_batch_size
    released = [p.grad * scale for p in model.parameters() if p.requires_grad]
    error = math.sqrt(sum(float(((r - e) ** 2).sum()) for r, e in zip(released, expected)))
    size = math.sqrt(sum(float((e ** 2).sum()) for e in expected))
    return {"relative_error": error / size, "examples": workload.batch, "clipped": int((norms > bound).sum())}


def clip_bound(name: str, tiny: bool, device: str, copies: int = 8) -> dict:
    """Whether the release keeps the clip bound in the model's own precision (float32, or bf16 autocast)
    on ``device``, with the device's default TF32 settings: ``copies`` copies of one example (dropout
    off), every copy clipped (bound 10⁻⁴), noise multiplier 0, all-layer. Each copy then adds exactly
    R·g/‖g‖, so the released sum's norm must be copies·R; ``relative_error`` is
    |‖release‖ / (copies·R) − 1| (float32 rounding: ~1e-6; products in TF32: ~1e-3)."""
    import torch

    import tunefree

    workload = build(name, tiny, device, dropout=False, batch=1, length=16)
    repeat = (lambda t: t.expand(copies, *t.shape[1:]).contiguous())  # noqa: E731
    workload.inputs = ({k: repeat(v) for k, v in workload.inputs.items()} if isinstance(workload.inputs, dict)
                       else repeat(workload.inputs))
    workload.targets, workload.batch = repeat(workload.targets), copies
    model, bound = workload.model, 1e-4
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = tunefree.make_private(model, optimizer, _loader(copies), target_delta=1e-5,
                                       noise_multiplier=0.0, clipping="abadi", max_grad_norm=bound,
                                       groups="all-layer", seed=0, poisson_sampling=False,
                                       loss_reduction="sum")
    autocast = (torch.autocast(torch.device(device).type, dtype=workload.autocast)
                if workload.autocast is not None else _nothing())
    with autocast:
        losses = per_example_loss(workload.task, logits_of(workload, model), workload.targets)
    losses.sum().backward()
    engine.optimizer.step()
    released = [p.grad.double() * engine.optimizer.expected_batch_size for p in model.parameters()
                if p.requires_grad]
    norm = math.sqrt(sum(float((g * g).sum()) for g in released))
    return {"relative_error": abs(norm / (copies * bound) - 1), "examples": copies, "clipped": copies,
            "dtype": "bf16 autocast" if workload.autocast is not None else "float32"}


def child(args) -> None:
    print(json.dumps(run_check_or_method(args.child[0], args.child[1], args)))


def run_check_or_method(name: str, method: str, args) -> dict:
    """One (model, method or check), as a result dict with its ``status`` (a failure is a result)."""
    try:
        if method == "exactness":
            result = exactness(name, args.tiny, args.device)
        elif method == "clip-bound":
            result = clip_bound(name, args.tiny, args.device)
        else:
            shape = {"batch": args.batch, "length": args.length, "layers": args.layers}
            result = measure(name, method, args.tiny, args.device, args.steps, args.warmup, args.seconds,
                             shape)
        result["status"] = "ok"
    except Missing as error:
        result = {"status": "missing", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - any failure of a method is a result of the benchmark
        result = {"status": "failed", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return result


# --------------------------------------------------------------------------------------------------- parent
def run_child(name: str, method: str, args, timeout: float) -> dict:
    command = [sys.executable, __file__, "--child", name, method, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--seconds", str(args.seconds),
               *(["--tiny"] if args.tiny else []),
               *[arg for key in ("batch", "length", "layers") if getattr(args, key)
                 for arg in (f"--{key}", str(getattr(args, key)))]]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "error": f"exit {out.returncode}: {tail[:200]}"}


def run(args) -> dict:
    """Every (model, method) and each model's exactness check, in fresh processes, within the time limit."""
    results: dict = {}
    start = time.perf_counter()
    for name in args.models:
        results[name] = {}
        for method in [*args.methods, *(CHECKS if args.exactness else ())]:
            left = args.time_limit - (time.perf_counter() - start)
            if left < 5:
                results[name][method] = {"status": "skipped", "error": "time limit"}
                continue
            result = (run_check_or_method(name, method, args) if args.in_process
                      else run_child(name, method, args, min(left, args.child_limit)))
            results[name][method] = result
            print(f"{name:18s} {method:22s} {_cell(result, None)}", file=sys.stderr, flush=True)
    return {"models": results, "device": args.device, "tiny": args.tiny,
            "seconds": round(time.perf_counter() - start, 1)}


def _cell(result: dict, base: dict | None) -> str:
    status = result.get("status")
    if status == "missing":
        return result["error"]
    if status == "skipped":
        return f"skipped ({result['error']})"
    if status != "ok":
        return f"fails: {result.get('error', status)}"
    if "relative_error" in result:
        return f"{result['relative_error']:.1e} ({result['clipped']} of {result['examples']} clipped)"
    text = f"{result['step_ms']:.1f} ms, {result['peak_mb']:.0f} MB"
    if base is not None and base.get("status") == "ok" and result is not base:
        text = (f"{result['step_ms'] / base['step_ms']:.2f}× / {result['peak_mb'] / base['peak_mb']:.2f}× "
                f"({text})")
    return text


def table(report: dict) -> str:
    """Markdown: one row per model, one column per method; private methods as time / memory ratios to
    non-private training in the same run (absolute figures beside them)."""
    columns = [m for m in METHODS if any(m in row for row in report["models"].values())]
    checks = {"exactness": "zero-noise release vs float64 loop",
              "clip-bound": "‖release‖ vs the clip bound (all copies clipped, device's TF32 defaults)"}
    checks = {key: label for key, label in checks.items()
              if any(key in row for row in report["models"].values())}
    header = ["model", *columns, *checks.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in report["models"].items():
        base = row.get("non-private")
        cells = [_cell(row[m], base) if m in row else "" for m in columns]
        cells += [_cell(row[key], None) if key in row else "" for key in checks]
        lines.append("| " + " | ".join([LABELS.get(name, name), *cells]) + " |")
    devices = {r.get("device") for row in report["models"].values() for r in row.values() if r.get("device")}
    lines.append("")
    lines.append(f"Device: {', '.join(sorted(devices)) or report['device']}; {report['seconds']} s in all"
                 + ("; --tiny (toy sizes)" if report["tiny"] else "") + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="toy sizes of the same architectures (CPU smoke)")
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help=f"any of {', '.join(MODELS + EXTRA_MODELS)}")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=None, help="examples per step instead of the model's")
    parser.add_argument("--length", type=int, default=None, help="tokens per example instead of the model's")
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 blocks instead of the model's")
    parser.add_argument("--no-exactness", dest="exactness", action="store_false",
                        help="skip the float64 zero-noise check and the clip-bound check")
    parser.add_argument("--in-process", action="store_true",
                        help="run every (model, method) in this process (a quick smoke run: memory figures "
                             "then include what earlier rows left behind)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per child (at most)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="a child stops timing after this long (at least 3 steps)")
    parser.add_argument("--time-limit", type=float, default=330.0,
                        help="seconds for the whole run; children not started by then are reported skipped")
    parser.add_argument("--child-limit", type=float, default=60.0, help="seconds one child may take")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here; "
                             "run on a GPU machine or pass --device cpu --tiny")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or "non-private" not in args.methods:
        raise SystemExit(f"--methods must include non-private and be among {', '.join(METHODS)}")
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
