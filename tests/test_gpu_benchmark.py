"""``benchmarks/gpu.py`` runs its whole code path on a CPU (``--device cpu --tiny``): fresh processes per
(model, method), the markdown table and JSON, the float64 zero-noise exactness check, and a row whose package
is missing (torchvision here) reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu  # noqa: E402 - the benchmark script, importable from its folder


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
