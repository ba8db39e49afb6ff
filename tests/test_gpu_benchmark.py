"""``benchmarks/gpu.py`` runs its whole code path on a CPU (``--device cpu --tiny``): fresh processes per
(model, method), the markdown table and JSON, the float64 zero-noise exactness check, and a row whose package
is missing (torchvision here) reported as such. ``benchmarks/gpu_session.sh`` (the prepared GPU check) runs
end to end on a CPU, and its offline recipe carries every package ``import tunefree`` and a private step
import that the GPU machine's image lacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu  # noqa: E402 - the benchmark script, importable from its folder


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_a_cpu_with_tiny_models(tmp_path):
    report_file = tmp_path / "gpu.json"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--device", "cpu", "--tiny", "--models", "gpt2-small",
         "--methods", "non-private", "tunefree-per-secret", "--steps", "3", "--warmup", "1",
         "--json", str(report_file), "--time-limit", "600", "--child-limit", "300"],
        capture_output=True, text=True, check=True, timeout=900)
    report = json.loads(report_file.read_text())
    gpt2 = report["models"]["gpt2-small"]
    for method in ("non-private", "tunefree-per-secret"):
        assert gpt2[method]["status"] == "ok", gpt2[method]
        assert gpt2[method]["step_ms"] > 0 and gpt2[method]["steps"] == 3
    assert gpt2["exactness"]["status"] == "ok", gpt2["exactness"]
    assert gpt2["exactness"]["relative_error"] < 1e-12  # float64 release against the float64 loop
    assert 0 < gpt2["exactness"]["clipped"] < gpt2["exactness"]["examples"]
    assert "| GPT-2 small fp32, 16 × 256 | " in out.stdout and "×" in out.stdout


def test_a_row_without_torchvision_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as on a machine without it: import fails
    with pytest.raises(gpu.Missing, match="torchvision not installed"):
        gpu.build("vit-b16", tiny=True, device="cpu")
    gpu.child(_Args())
    child = json.loads(capsys.readouterr().out)
    assert child == {"status": "missing", "error": "torchvision not installed"}
    report = {"device": "cpu", "tiny": True, "seconds": 1.0,
              "models": {"resnet18-gn": {"non-private": child}}}
    assert "| ResNet-18 (GroupNorm) 32×32, batch 256 | torchvision not installed |" in gpu.table(report)


class _Args:
    child = ("resnet18-gn", "non-private")
    device, steps, warmup, seconds, tiny, batch, length, layers = "cpu", 3, 1, 4.0, True, None, None, None


def test_the_table_reports_failures_and_ratios():
    report = {"device": "cuda", "tiny": False, "seconds": 1.0, "models": {"bert-base": {
        "non-private": {"status": "ok", "step_ms": 100.0, "peak_mb": 1000.0, "device": "NVIDIA H200"},
        "tunefree-all-seeded": {"status": "ok", "step_ms": 129.0, "peak_mb": 1010.0, "device": "NVIDIA H200"},
        "opacus-hooks": {"status": "failed", "error": "RuntimeError: in-place ReLU"},
        "exactness": {"status": "ok", "relative_error": 8e-14, "clipped": 1, "examples": 3}}}}
    text = gpu.table(report)
    assert "| BERT-base fp32, 32 × 256 | 100.0 ms, 1000 MB | 1.29× / 1.01× (129.0 ms, 1010 MB) | " \
           "fails: RuntimeError: in-place ReLU | 8.0e-14 (1 of 3 clipped) |" in text
    assert "Device: NVIDIA H200" in text


@pytest.mark.slow
def test_the_prepared_gpu_session_runs_end_to_end_on_a_cpu(tmp_path):
    """``gpu_session.sh --device cpu --tiny``: the environment, the kernel (interpreted) against RFC 8439 and
    the CPU path at several draws, its timing at each launch configuration, and the model rows with their
    exactness and clip-bound checks, written as JSON; every check passes."""
    out = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), "--device", "cpu", "--tiny", "--out",
                          str(tmp_path)], env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    session = json.loads((tmp_path / "session.json").read_text())
    environment = session["environment"]
    assert {"python", "torch", "device", "c_compiler", "python_h", "modules", "noise_paths"} <= set(
        environment)
    modules = environment["modules"]
    assert not any(modules[name].startswith("missing") for name in ("tunefree", "cryptography"))
    kernel = session["kernel"]
    assert kernel["passed"] and all(all(rows.values()) for rows in kernel["keystream"].values())
    draws = {row["draw"] for row in kernel["draws"]}
    assert len(draws) >= 3 and max(draws) >= 2**31
    assert {row["warps"] for row in kernel["draws"]} == {2, 4, 8}
    assert all(row["bit_equal"] for row in kernel["torch_ops"])  # the fallback: the CPU path's numbers
    timing = session["kernel_timing"][0]
    assert all(f"kernel, {warps} warps ms" in timing for warps in (2, 4, 8)) and "torch.randn ms" in timing
    models = session["models"]["models"]
    assert set(models) == {"resnet18-gn", "gpt2-small", "gpt2-small-bf16"}
    for name in ("gpt2-small", "gpt2-small-bf16"):
        for method in ("non-private", "tunefree-all-seeded", "tunefree-all-secret", "opacus-hooks"):
            assert models[name][method]["status"] == "ok", (name, method, models[name][method])
            assert "syncs_per_step" in models[name][method]
        assert models[name]["exactness"]["relative_error"] < 1e-10
        assert models[name]["clip-bound"]["relative_error"] < 1e-4
        assert "secret vs seeded time" in session["models"]["ratios"][name]
    assert session["exactness_passed"] and session["passed"]
    assert (tmp_path / "session.md").read_text().startswith("| model |")


IMPORTS = """
import importlib.abc, json, sys
edges = set()

class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        importer = (frame.f_globals.get("__name__") or "") if frame is not None else ""
        edges.add((importer.split(".")[0], name.split(".")[0]))
        return None

sys.meta_path.insert(0, Recorder())
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import tunefree

model = nn.Linear(3, 2)
data = TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(data, batch_size=5), target_epsilon=3.0, target_delta=1e-5,
                               epochs=1)
x, y = next(iter(engine.data_loader))
torch.nn.functional.cross_entropy(model(x), y).backward()
engine.optimizer.step()
engine.epsilon()
loaded = {name.split(".")[0] for name in sys.modules}
print(json.dumps([[a, b] for a, b in edges if b in loaded]))
"""


@pytest.mark.slow
def test_the_offline_recipe_carries_what_tunefree_imports_and_the_gpu_image_lacks():
    """``import tunefree`` and a private step (sampling, the secret source, the accountant) in a fresh
    process, every import recorded with its importer: the third-party packages reached from tunefree,
    through the packages the recipe carries (a carried wheel brings none of its dependencies), must each
    be carried (``gpu.OFFLINE_WHEELS``) or on the GPU machine's image (``gpu.GPU_IMAGE``, which brings its
    own dependencies); docs/gpu.md lists the same wheels."""
    import importlib.metadata

    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True,
                         timeout=300)
    edges = json.loads(out.stdout.strip().splitlines()[-1])
    distributions = importlib.metadata.packages_distributions()

    def distribution(module: str) -> str | None:
        if module in sys.stdlib_module_names or module in ("__main__", "tunefree"):
            return None
        names = distributions.get(module)
        return names[0].lower().replace("_", "-") if names else None

    carried = {wheel.split("==")[0] for wheel in gpu.OFFLINE_WHEELS}
    importers: dict[str, set[str]] = {}
    for importer, module in edges:
        importers.setdefault(importer, set()).add(module)
    needed, frontier, seen = set(), ["tunefree"], set()
    while frontier:
        importer = frontier.pop()
        if importer in seen:
            continue
        seen.add(importer)
        for module in importers.get(importer, ()):
            name = distribution(module)
            if name is None:
                if module not in sys.stdlib_module_names:
                    frontier.append(module)  # a module of the importer's own package (e.g. a native part)
                continue
            needed.add(name)
            if name not in gpu.GPU_IMAGE:  # the image's packages come with their own dependencies
                frontier.append(module)
    assert {"cryptography", "cffi", "dp-accounting"} <= needed, needed
    missing = needed - carried - set(gpu.GPU_IMAGE)
    assert not missing, f"imported but neither carried nor on the GPU image: {missing}"
    guide = (ROOT / "docs" / "gpu.md").read_text()
    assert all(wheel in guide for wheel in gpu.OFFLINE_WHEELS)
    assert all(re.search(rf"\b{re.escape(wheel)}\b", gpu.__doc__) for wheel in gpu.OFFLINE_WHEELS)
