"""One prepared GPU check (issue 31): the environment, the secret-noise kernel, and private steps of three
models against non-private training and Opacus, as JSON — in one command, within 8 minutes on one
H100/H200, offline with only wheels carried (docs/gpu.md, *A GPU session*)::

    bash benchmarks/gpu_session.sh [--out DIR]                      (on the GPU; DIR: $OUT, else gpu-session)
    bash benchmarks/gpu_session.sh --device cpu --tiny --out DIR    (the same code on a CPU: the test suite)

1. Environment: versions, the device, the C compiler and ``Python.h`` Triton builds its launcher with,
   each module tunefree and the benchmark import, and the path secret noise takes on the device (the
   kernel's probe draw builds, runs and matches the CPU path, per dtype; its compile time).
2. The noise kernel: its keystream against RFC 8439's vectors and OpenSSL's at other counters and nonces,
   bit for bit; its Gaussians against the CPU path's at several draw numbers (nonce words 14 and 15 both
   in use), dtypes and launch configurations, in units in the last place; the torch-operations path
   (the fallback) likewise.
3. Time of one draw of 16.8M and 124M float32 Gaussians at each launch configuration (``warps`` per
   program), against ``torch.randn``, the torch-operations path and the CPU path (CUDA events, medians).
4. ResNet-18-GN, GPT-2 fp32 and GPT-2 bf16 (``benchmarks/gpu.py``, each (model, method) in a fresh
   process): non-private, tunefree seeded, tunefree secret (the default), Opacus hooks — step time and
   peak memory, their ratios to non-private, secret against seeded, synchronisations per step
   (``torch.cuda.set_sync_debug_mode``), the float64 zero-noise exactness and the clip bound of the
   model's own precision under the device's TF32 defaults.

``passed`` is true when every check of 2 holds and every exactness and clip-bound check that ran is within
its tolerance. On ``--device cpu`` the kernel runs in Triton's interpreter (one group per draw), rows run
in this process, and timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace

RFC_KEY = bytes(range(32))
RFC_BLOCK_NONCE = struct.unpack("<3I", bytes.fromhex("000000090000004a00000000"))  # RFC 8439 §2.3.2
RFC_BLOCK = bytes.fromhex("10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
                          "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")
MODELS = ("resnet18-gn", "gpt2-small", "gpt2-small-bf16")
METHODS = ("non-private", "tunefree-all-seeded", "tunefree-all-secret", "opacus-hooks")
TOLERANCES = {"exactness": 1e-10, "clip-bound": 1e-4}  # float64 loop; float32 rounding (TF32: ~1e-3)
MAX_ULPS = {"torch.float32": 8, "torch.float64": 8, "torch.bfloat16": 1}
# (dtype, draw number, warps per program): draws ≥ 2³¹ use nonce word 15, every launch configuration
DRAWS = (("float32", 0, 2), ("float32", 5, 4), ("float32", 2**31 + 3, 8), ("float32", 2**40 + 7, 4),
         ("bfloat16", 1, 4), ("float64", 2**33, 4))
TINY_DRAWS = (DRAWS[0], DRAWS[2], DRAWS[4], DRAWS[5])  # interpreted launches take seconds each
KEYSTREAM_CHECKS = ((1, RFC_BLOCK_NONCE, 1), (2**32 - 5, (0, 9, 1), 5), (3, (0, 0, 2**30), 5))


def log(message: str) -> None:
    print(f"[gpu_session {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ environment
def environment(device) -> dict:
    import importlib

    import torch

    from tunefree.privacy import chacha20

    modules = {}
    for name in ("tunefree", "cryptography", "_cffi_backend", "dp_accounting", "tree", "opacus", "triton",
                 "transformers", "peft", "torchvision"):
        try:
            module = importlib.import_module(name)
            modules[name] = getattr(module, "__version__", "ok")
        except Exception as error:  # noqa: BLE001 - a missing module is what this reports
            modules[name] = f"missing: {type(error).__name__}: {error}"[:200]
    include = sysconfig.get_paths()["include"]
    result = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "c_compiler": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"),
              "python_h": str(Path(include, "Python.h")) if Path(include, "Python.h").exists() else None,
              "modules": modules, "noise_paths": {}}
    if device.type == "cuda":
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            start = time.perf_counter()
            failure = chacha20.kernel_failure(device, dtype)  # builds the kernel: compile time included
            result["noise_paths"][str(dtype)] = {
                "path": chacha20.KERNEL if failure is None else chacha20.TORCH_OPS, "why": failure,
                "probe_seconds": round(time.perf_counter() - start, 1)}
    else:
        result["noise_paths"]["cpu"] = {"path": chacha20.OPENSSL, "why": "the kernel runs interpreted here"}
    return result


# ----------------------------------------------------------------------------------------------- kernel
def _ulps(a, b) -> int:
    import torch

    integer = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
    return int((a.view(integer).long() - b.view(integer).long()).abs().max())


def _at_draw(generator, draw: int, path: str, count: int, device, dtype):
    state = generator._state()
    counter, state.draws = state.draws, iter([draw])
    try:
        return generator.normals_by(path, count, device, dtype)
    finally:
        state.draws = counter


def kernel_checks(device, tiny: bool) -> dict:
    import torch

    from tunefree.privacy import chacha20, chacha20_triton
    from tunefree.privacy.chacha20 import ChaCha20Generator, Keystream

    def openssl(key: bytes, counter: int, nonce, blocks: int) -> bytes:
        return b"".join(w.numpy().tobytes() for _, w in Keystream(key, counter, nonce, blocks).chunks())

    out: dict = {"keystream": {}, "draws": [], "torch_ops": []}
    key_words = torch.frombuffer(bytearray(RFC_KEY), dtype=torch.int32).to(device)
    for name, make in (("kernel", chacha20_triton.keystream), ("torch_ops", None)):
        rows = {}
        checks = KEYSTREAM_CHECKS[:1] if tiny and make is not None else KEYSTREAM_CHECKS
        for counter, nonce, blocks in checks:  # nonce words 13-15 (RFC's, then draws 2³¹ + 9 and 2⁶¹)
            if make is None:
                words = chacha20.device_keystream(key_words, counter, nonce, blocks)
            else:
                words = torch.zeros(blocks, 16, dtype=torch.int32, device=device)
                make(words, key_words, counter, nonce)
            got = words.cpu().numpy().tobytes()
            expected = RFC_BLOCK if counter == 1 else openssl(RFC_KEY, counter, nonce, blocks)
            rows[f"counter {counter}, nonce {list(nonce)}"] = got == expected
        out["keystream"][name] = rows
    generator = ChaCha20Generator()
    key = generator.device_key(device)
    groups = 1 if tiny else 64
    for dtype_name, draw, warps in TINY_DRAWS if tiny else DRAWS:
        dtype = getattr(torch, dtype_name)
        on_device = torch.empty(groups * 2048, device=device, dtype=dtype)
        chacha20_triton.normals(on_device, key, draw, warps=warps)
        cpu = _at_draw(generator, draw, chacha20.OPENSSL, groups * 2048, torch.device("cpu"), dtype)
        got = on_device.cpu()
        out["draws"].append({"dtype": str(dtype), "draw": draw, "warps": warps, "gaussians": groups * 2048,
                             "max_ulps": _ulps(got, cpu),
                             "max_abs": float((got.double() - cpu.double()).abs().max()),
                             "bit_equal_share": float((got == cpu).double().mean())})
    for dtype_name, draw in (("float32", 7), ("float64", 2**31 + 1)):
        dtype = getattr(torch, dtype_name)
        fallback = _at_draw(generator, draw, chacha20.TORCH_OPS, groups * 2048, device, dtype).cpu()
        cpu = _at_draw(generator, draw, chacha20.OPENSSL, groups * 2048, torch.device("cpu"), dtype)
        out["torch_ops"].append({"dtype": str(dtype), "draw": draw, "max_ulps": _ulps(fallback, cpu),
                                 "bit_equal": bool(torch.equal(fallback, cpu))})
    keystreams_ok = all(all(rows.values()) for rows in out["keystream"].values())
    draws_ok = all(row["max_ulps"] <= MAX_ULPS[row["dtype"]] for row in out["draws"] + out["torch_ops"])
    bit_equal_on_cpu = device.type != "cpu" or all(row["bit_equal"] for row in out["torch_ops"])
    out["passed"] = keystreams_ok and draws_ok and bit_equal_on_cpu
    return out


def kernel_timing(device, tiny: bool) -> list[dict]:
    import torch
    from gpu_noise import timed

    from tunefree.privacy import chacha20, chacha20_triton
    from tunefree.privacy.chacha20 import ChaCha20Generator

    generator = ChaCha20Generator()
    key = generator.device_key(device)
    counts = (2048,) if tiny else (16_796_672, 124_000_256)  # whole groups
    repeats, warmup = (1, 0) if tiny else (10, 2)
    rows = []
    for count in counts:
        out = torch.empty(count, device=device, dtype=torch.float32)
        randn = lambda n=count: torch.randn(n, device=device)  # noqa: E731
        row = {"gaussians": count, "torch.randn ms": timed(randn, device, repeats, warmup)}
        for warps in chacha20_triton.LAUNCH_WARPS:
            draw = lambda out=out, w=warps: chacha20_triton.normals(out, key, 0, warps=w)  # noqa: E731
            row[f"kernel, {warps} warps ms"] = timed(draw, device, repeats, warmup)
        if count < 50_000_000:  # the slower paths at the smaller size only
            for label, path, reps in (("torch-ops path ms", chacha20.TORCH_OPS, 1 if tiny else 3),
                                      ("CPU path and copy ms", chacha20.OPENSSL, 1)):
                row[label] = timed(lambda n=count, p=path: generator.normals_by(p, n, device, torch.float32),
                                    device, reps, 0 if tiny else 1)
        best = min(v for k, v in row.items() if k.startswith("kernel"))
        row["best kernel GB/s written"] = 4 * count / best / 1e6
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ models
def models(device, tiny: bool, time_limit: float) -> dict:
    import gpu

    args = SimpleNamespace(models=list(MODELS), methods=list(METHODS), exactness=True, in_process=tiny,
                           device=device.type if device.type == "cpu" else str(device), tiny=tiny,
                           steps=3 if tiny else 8, warmup=1 if tiny else 2, seconds=4.0, batch=None,
                           length=None, layers=None, time_limit=time_limit, child_limit=120.0)
    report = gpu.run(args)
    ratios = {}
    for name, row in report["models"].items():
        base = row.get("non-private", {})
        if base.get("status") != "ok":
            continue
        ratios[name] = {method: {"time": row[method]["step_ms"] / base["step_ms"],
                                 "memory": row[method]["peak_mb"] / max(base["peak_mb"], 1e-9)}
                        for method in METHODS[1:] if row.get(method, {}).get("status") == "ok"}
        seeded, secret = row.get("tunefree-all-seeded", {}), row.get("tunefree-all-secret", {})
        if seeded.get("status") == secret.get("status") == "ok":
            ratios[name]["secret vs seeded time"] = secret["step_ms"] / seeded["step_ms"]
    report["ratios"] = ratios
    report["table"] = gpu.table(report)
    return report


def exactness_passed(report: dict) -> bool:
    """Every exactness and clip-bound check that ran is within its tolerance, and at least one ran."""
    ran = [(check, row[check]) for row in report["models"].values() for check in TOLERANCES if check in row]
    finished = [(check, result) for check, result in ran if result.get("status") in ("ok", "failed")]
    within = [result.get("status") == "ok" and result["relative_error"] < TOLERANCES[check]
              for check, result in finished]
    return bool(within) and all(within)


# -------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: a smoke run)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, rows in this process")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-session",
                        help="folder for session.json and session.md ($OUT by default)")
    parser.add_argument("--time-limit", type=float, default=420.0,
                        help="seconds for the whole session; model rows not started by then are skipped")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernel runs on the CPU
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; "
                             "use --device cpu --tiny for a smoke run")
        device = torch.device("cuda", torch.cuda.current_device())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    session: dict = {"device": args.device, "tiny": args.tiny}

    def save() -> None:
        session["seconds"] = round(time.perf_counter() - started, 1)
        (out_dir / "session.json").write_text(json.dumps(session, indent=1, default=str))

    for name, section in (("environment", lambda: environment(device)),
                          ("kernel", lambda: kernel_checks(device, args.tiny)),
                          ("kernel_timing", lambda: kernel_timing(device, args.tiny))):
        log(f"{name} …")
        try:
            session[name] = section()
        except Exception as error:  # noqa: BLE001 - a failing section is reported, the rest still runs
            session[name] = {"failed": f"{type(error).__name__}: {error}"[:400]}
        log(f"{name}: {json.dumps(session[name], default=str)[:600]}")
        save()
    left = args.time_limit - (time.perf_counter() - started)
    log(f"models ({left:.0f} s left) …")
    session["models"] = models(device, args.tiny, left)
    session["exactness_passed"] = exactness_passed(session["models"])
    session["passed"] = bool(session["kernel"].get("passed")) and session["exactness_passed"]
    save()
    (out_dir / "session.md").write_text(session["models"]["table"] + "\n")
    print(session["models"]["table"])
    log(f"passed: {session['passed']}; {session['seconds']} s; {out_dir / 'session.json'}")


if __name__ == "__main__":
    main()
