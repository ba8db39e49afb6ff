"""The secret source's generator (privacy/chacha20.py, privacy/chacha20_triton.py): ChaCha20 bit for bit as
RFC 8439 defines it, on the CPU (OpenSSL) and in the CUDA kernel (run here in Triton's interpreter); the
layout of the module's docstring; Gaussians that are standard normal to the tails; and numbers that never
repeat between releases, ranks or forked processes."""

from __future__ import annotations

import importlib.util
import math
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from tunefree.privacy import chacha20
from tunefree.privacy.chacha20 import PAIRS, ChaCha20Generator, Keystream, group_blocks, nonce_words
from tunefree.privacy.randomness import SecretSource

CPU = torch.device("cpu")
RFC_KEY = bytes(range(32))
# RFC 8439 §2.3.2: the block function at counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00
BLOCK_NONCE = struct.unpack("<3I", bytes.fromhex("000000090000004a00000000"))
BLOCK_232 = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")
# RFC 8439 §2.4.2: encryption from counter 1 under nonce 00:00:00:00:00:00:00:4a:00:00:00:00
CIPHER_NONCE = struct.unpack("<3I", bytes.fromhex("000000000000004a00000000"))
PLAINTEXT = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
             b"sunscreen would be it.")
CIPHERTEXT_242 = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0bf91b65c5524733ab8f593dabcd62b357"
    "1639d624e65152ab8f530c359f0861d807ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d")


def reference_block(key: bytes, counter: int, nonce: tuple[int, int, int]) -> bytes:
    """RFC 8439 §2.3's block function, written out in plain Python integers."""
    mask = 0xFFFFFFFF

    def quarter(x, a, b, c, d):
        for p, q, r, shift in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
            x[p] = (x[p] + x[q]) & mask
            x[r] ^= x[p]
            x[r] = ((x[r] << shift) | (x[r] >> (32 - shift))) & mask

    state = [*struct.unpack("<4I", b"expand 32-byte k"), *struct.unpack("<8I", key), counter & mask, *nonce]
    x = list(state)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                           (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            quarter(x, a, b, c, d)
    return struct.pack("<16I", *((x[i] + state[i]) & mask for i in range(16)))


def cpu_keystream(key: bytes, counter: int, nonce: tuple[int, int, int], blocks: int) -> bytes:
    return b"".join(w.numpy().tobytes() for _, w in Keystream(key, counter, nonce, blocks, chunk=3).chunks())


def test_the_cpu_keystream_is_rfc_8439_chacha20():
    assert reference_block(RFC_KEY, 1, BLOCK_NONCE) == BLOCK_232  # the reference is the RFC's function
    assert cpu_keystream(RFC_KEY, 1, BLOCK_NONCE, 1) == BLOCK_232
    stream = cpu_keystream(RFC_KEY, 1, CIPHER_NONCE, 2)
    assert bytes(p ^ k for p, k in zip(PLAINTEXT, stream)) == CIPHERTEXT_242
    key = os.urandom(32)  # any key, counter and nonce, across chunk boundaries (chunks of 3 blocks)
    assert cpu_keystream(key, 7, nonce_words(2**40 + 5), 8) == b"".join(
        reference_block(key, 7 + i, nonce_words(2**40 + 5)) for i in range(8))


@pytest.fixture(scope="module")
def kernel():
    """privacy/chacha20_triton.py loaded afresh with TRITON_INTERPRET=1 (kept while its tests run): its
    kernels run on the CPU, in Triton's interpreter."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    path = os.path.join(os.path.dirname(chacha20.__file__), "chacha20_triton.py")
    spec = importlib.util.spec_from_file_location("tunefree.privacy._chacha20_triton_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous


def kernel_keystream(kernel, key: bytes, counter: int, nonce: tuple[int, int, int], blocks: int) -> bytes:
    out = torch.zeros(blocks, 16, dtype=torch.int32)
    kernel.keystream(out, torch.frombuffer(bytearray(key), dtype=torch.int32), counter, nonce)
    return out.numpy().tobytes()


def test_the_kernels_keystream_is_rfc_8439_chacha20(kernel):
    assert kernel_keystream(kernel, RFC_KEY, 1, BLOCK_NONCE, 1) == BLOCK_232
    stream = kernel_keystream(kernel, RFC_KEY, 1, CIPHER_NONCE, 2)
    assert bytes(p ^ k for p, k in zip(PLAINTEXT, stream)) == CIPHERTEXT_242


def layout_reference(key: bytes, draw: int, dtype: torch.dtype) -> np.ndarray:
    """The first group of Gaussians of draw ``draw``, from the reference block function and the module
    docstring's formulas, in float64."""
    words = b"".join(reference_block(key, b, nonce_words(draw)) for b in range(group_blocks(dtype)))
    radius = np.frombuffer(words[:8 * PAIRS], dtype="<i8").astype(np.float64)
    angle = np.frombuffer(words[8 * PAIRS:], dtype="<i8" if dtype == torch.float64 else "<i4")
    r = np.sqrt(-2 * np.log(np.abs(radius + 0.5) * 2.0**-63))
    theta = 2 * np.pi * angle.astype(np.float64) * (2.0**-64 if dtype == torch.float64 else 2.0**-32)
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])


def formula(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The Gaussians of whole groups of keystream ``words`` (int32, one row per group) by the module
    docstring's formulas, each operation in its documented precision (numpy): ln in float64; √, the angle,
    cos, sin and the products in float32 (float64 for float64 outputs)."""
    radius = words[:, :2 * PAIRS].copy().view(np.int64).astype(np.float64)
    log_u = np.log(np.abs(radius + 0.5) * 2.0**-63)
    if dtype == torch.float64:
        r = np.sqrt(log_u * -2.0)
        theta = words[:, 2 * PAIRS:].copy().view(np.int64).astype(np.float64) * (2 * np.pi * 2.0**-64)
    else:
        r = np.sqrt(log_u.astype(np.float32) * np.float32(-2.0))
        theta = words[:, 2 * PAIRS:].astype(np.float32) * np.float32(2 * np.pi * 2.0**-32)
    return np.stack([r * np.cos(theta), r * np.sin(theta)], 1).reshape(-1)


def draw_words(key: bytes, draw: int, groups: int, dtype: torch.dtype) -> np.ndarray:
    words = cpu_keystream(key, 0, nonce_words(draw), groups * group_blocks(dtype))
    return np.frombuffer(words, dtype="<i4").reshape(groups, -1)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units in the last place (same signs)."""
    integer = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
    return int((a.view(integer).long() - b.view(integer).long()).abs().max())


def at_draw(generator: ChaCha20Generator, draw: int, path: str, count: int, device, dtype) -> torch.Tensor:
    """The Gaussians of draw number ``draw`` by ``path`` (the generator's counter left as it was)."""
    state = generator._state()
    counter, state.draws = state.draws, iter([draw])
    try:
        return generator.normals_by(path, count, device, dtype)
    finally:
        state.draws = counter


# (dtype, draw number, warps per program, groups): nonce words 14 and 15 both in use (draws ≥ 2³¹), every
# launch configuration, a last program with groups missing (3 groups at 2 or 4 per program), a 16-bit
# output (float16: Triton's interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest as torch
# does; benchmarks/gpu_session.py checks bfloat16 on the GPU)
KERNEL_DRAWS = [(torch.float32, 0, 2, 1), (torch.float32, 2**31 + 3, 4, 3), (torch.float32, 2**40 + 7, 8, 3),
                (torch.float64, 5, 8, 2), (torch.float64, 2**33, 4, 3), (torch.float16, 1, 8, 2)]


@pytest.mark.parametrize("dtype, draw, warps, groups", KERNEL_DRAWS)
@pytest.mark.slow
def test_the_kernel_computes_the_documented_gaussians_bit_for_bit(kernel, dtype, draw, warps, groups,
                                                                  monkeypatch):
    """The CUDA kernel (interpreted: numpy's arithmetic; one launch per draw, keystream, Box–Muller and the
    stores in one kernel) gives the docstring's formulas bit for bit at several draws (nonces) and launch
    configurations; the CPU path (torch's own ln, cos, sin) agrees within 3 units in the last place."""
    generator = ChaCha20Generator()
    launches, launch = [], kernel._normals_kernel.run
    monkeypatch.setattr(kernel._normals_kernel, "run", lambda *a, **k: launches.append(1) or launch(*a, **k))
    out = torch.full((groups * 2 * PAIRS,), float("nan"), dtype=dtype)
    kernel.normals(out, generator.device_key(CPU), draw, warps=warps)
    assert launches == [1]
    expected = torch.from_numpy(formula(draw_words(generator._key(), draw, groups, dtype), dtype)).to(dtype)
    assert torch.equal(out, expected)
    cpu = at_draw(generator, draw, chacha20.OPENSSL, groups * 2 * PAIRS, CPU, dtype)
    assert ulps(out, cpu) <= 3


@pytest.mark.slow
def test_a_draw_on_an_accelerator_uses_the_kernel_and_says_so(kernel, monkeypatch):
    """Where the probe draw builds and matches the CPU path, noise is made by the kernel (here: the CPU
    standing in for a CUDA device, the kernel interpreted), and the source's description says so."""
    monkeypatch.setattr(chacha20, "DEVICE_NOISE", frozenset({"cpu"}))
    monkeypatch.setattr(chacha20, "_triton_kernel", lambda: kernel)
    chacha20.kernel_failure.cache_clear()
    try:
        source = SecretSource()
        z = source.normal(torch.Size([3 * PAIRS]), CPU, torch.float32)  # 2 groups
        assert source._generator.path(CPU, torch.float32) == chacha20.KERNEL
        cpu = at_draw(source._generator, 0, chacha20.OPENSSL, 3 * PAIRS, CPU, torch.float32)
        assert ulps(z, cpu) <= 3 and not torch.equal(z, torch.zeros_like(z))
        assert source.description == f"secure (noise on cpu: {chacha20.PATHS[chacha20.KERNEL]})"
    finally:
        chacha20.kernel_failure.cache_clear()


class _LauncherNotBuilt:
    """The kernel module of a machine that imports triton but cannot build its launcher (no C compiler or
    no ``Python.h``): every launch raises what Triton's build step raises there."""

    def __init__(self):
        self.launches = 0

    def normals(self, *args, **kwargs):
        self.launches += 1
        raise RuntimeError("Failed to compile cuda_utils.c: fatal error: Python.h: No such file or directory")


def test_a_kernel_that_cannot_build_falls_back_to_torch_operations_with_the_same_numbers(monkeypatch):
    """Triton imports but its launcher does not build: the first draw probes once, warns, and every draw
    is made by ChaCha20 in torch operations on the device — the CPU path's numbers bit for bit (same
    keystream, same Box–Muller operations), no crash; the description names the path and the reason."""
    broken = _LauncherNotBuilt()
    monkeypatch.setattr(chacha20, "DEVICE_NOISE", frozenset({"cpu"}))
    monkeypatch.setattr(chacha20, "_triton_kernel", lambda: broken)
    monkeypatch.setattr(chacha20, "_DEVICE_CHUNK_GROUPS", 2)  # chunks of 2 groups: 5 groups in 3 chunks
    chacha20.kernel_failure.cache_clear()
    try:
        source = SecretSource()
        with pytest.warns(RuntimeWarning, match="torch operations.*Python.h"):
            draws = [source.normal(torch.Size([5 * 2 * PAIRS - 7]), CPU, dtype)
                     for dtype in (torch.float32, torch.float32, torch.float64)]
        assert broken.launches == 2  # one probe per dtype, then never again
        generator = source._generator
        for number, (z, dtype) in enumerate(zip(draws, (torch.float32, torch.float32, torch.float64))):
            assert torch.equal(z, at_draw(generator, number, chacha20.OPENSSL, z.numel(), CPU, dtype))
        assert source.description.startswith("secure (noise on cpu: ChaCha20 in torch operations on the "
                                             "device (the Triton kernel is not used: RuntimeError: Failed")
    finally:
        chacha20.kernel_failure.cache_clear()


def test_the_torch_operations_keystream_is_rfc_8439_chacha20_and_openssls_bit_for_bit():
    key = torch.frombuffer(bytearray(RFC_KEY), dtype=torch.int32)
    assert chacha20.device_keystream(key, 1, BLOCK_NONCE, 1).numpy().tobytes() == BLOCK_232
    stream = chacha20.device_keystream(key, 1, CIPHER_NONCE, 2).numpy().tobytes()
    assert bytes(p ^ k for p, k in zip(PLAINTEXT, stream)) == CIPHERTEXT_242
    secret = os.urandom(32)
    for counter, draw in ((0, 0), (2**32 - 40, 2**31 + 1), (7, 2**61)):
        words = chacha20.device_keystream(torch.frombuffer(bytearray(secret), dtype=torch.int32), counter,
                                          nonce_words(draw), 40)
        assert words.numpy().tobytes() == cpu_keystream(secret, counter, nonce_words(draw), 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_torch_operations_path_gives_the_cpu_paths_gaussians_bit_for_bit(dtype, monkeypatch):
    monkeypatch.setattr(chacha20, "MAX_BLOCKS", 2 * group_blocks(dtype) + 5)  # draws continue under the next
    monkeypatch.setattr(chacha20, "_DEVICE_CHUNK_GROUPS", 1)
    generator = ChaCha20Generator()
    count = 5 * 2 * PAIRS + 11  # 6 groups: 3 draw numbers of 2 groups, one group per chunk
    on_device = generator.normals_by(chacha20.TORCH_OPS, count, CPU, dtype)
    counter = generator._state().draws
    generator._state().draws = iter(range(3))
    assert torch.equal(on_device, generator.normals_by(chacha20.OPENSSL, count, CPU, dtype))
    assert next(counter) == 3  # the torch-operations path took draw numbers 0, 1, 2


class _FakeCuda:
    """Two CUDA devices as torch's current-device and current-stream calls see them (this machine has
    none): device 0 current, and each device's current stream, device 1's a side stream the user set."""

    def __init__(self):
        self.current, self.streams = 0, {0: 7000, 1: 7101}

    def exchange(self, index: int) -> int:
        previous = self.current
        if index >= 0:
            self.current = index
        return previous

    def current_stream(self, index=None):
        return SimpleNamespace(cuda_stream=self.streams[self.current if index is None else index])


class _OnCuda1:
    """A tensor's face to the launch code: float32, 2 groups, on cuda:1."""

    device, dtype, shape = torch.device("cuda", 1), torch.float32, (2, 16)

    def numel(self) -> int:
        return 2 * 2 * PAIRS


def test_the_kernels_launch_on_the_output_tensors_device_and_its_current_stream(kernel, monkeypatch):
    """With device 0 current and the output on cuda:1, Triton's launcher (which reads the current device
    and that device's current stream, as triton.backends.driver.GPUDriver does) sees cuda:1 and cuda:1's
    current stream at each launch — not device 0's — and device 0 is current again afterwards."""
    from triton.backends.driver import GPUDriver

    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "_exchange_device", fake.exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", fake.exchange)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    driver = SimpleNamespace()
    GPUDriver.__init__(driver)  # Triton's own device and stream queries, bound to torch's calls
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                device = driver.get_current_device()
                launches.append((device, driver.get_current_stream(device)))
            return launch

    monkeypatch.setattr(kernel, "_normals_kernel", Launcher())
    monkeypatch.setattr(kernel, "_keystream_kernel", Launcher())
    out = _OnCuda1()
    kernel.normals(out, out, draw=3)
    kernel.keystream(out, out, 0, (0, 0, 0))
    assert launches == [(1, 7101), (1, 7101)] and fake.current == 0


def test_extreme_words_give_finite_gaussians_with_tails_beyond_nine_sigma():
    """u = |R + ½|·2⁻⁶³ is never 0: R = 0 or −1 gives the largest radius √(128 ln 2) ≈ 9.42, R = −2⁶³ the
    radius 0; a draw never holds inf or nan."""
    words = torch.zeros(1, group_blocks(torch.float32) * 16, dtype=torch.int32)
    radius = words[:, :2 * PAIRS].view(torch.int64)
    radius[0, :4] = torch.tensor([0, -1, -(2**63), 2**62])
    out = torch.empty(1, 2, PAIRS)
    chacha20.normals_from_words(words, out, chacha20._Scratch(1, torch.float32))  # angle 0: z = r
    largest = math.sqrt(128 * math.log(2))
    assert out[0, 0, :4].tolist() == pytest.approx([largest, largest, 0.0, math.sqrt(2 * math.log(2))])
    z = ChaCha20Generator().normals(1 << 20, CPU, torch.float32)
    assert bool(torch.isfinite(z).all())


def test_gaussians_are_standard_normal_to_the_tails():
    """2²⁴ float32 Gaussians (drawn in pieces): moments, a Kolmogorov–Smirnov test, the counts beyond
    3σ, 4σ and 5σ against their expectations, the shape of the tail beyond 4σ, and beyond 6σ no more
    than chance allows."""
    generator, pieces, size = ChaCha20Generator(), 4, 1 << 22
    n = pieces * size
    moments, beyond, tail = np.zeros(4), dict.fromkeys((3, 4, 5, 6), 0), []
    for _ in range(pieces):
        z = generator.normals(size, CPU, torch.float32).double()
        square = z * z
        moments += [float(t.sum()) for t in (z, square, square * z, square * square)]
        magnitude = z.abs_()
        large = magnitude[magnitude > 3]
        for k in beyond:
            beyond[k] += int((large > k).sum())
        tail.append(large[large > 4].numpy())
    mean, second, third, fourth = moments / n
    assert abs(mean) < 6 / math.sqrt(n) and abs(second - 1) < 6 * math.sqrt(2 / n)
    assert abs(third) < 6 * math.sqrt(15 / n) and abs(fourth - 3) < 6 * math.sqrt(96 / n)
    for k in (3, 4, 5):
        expected = n * math.erfc(k / math.sqrt(2))
        assert abs(beyond[k] - expected) < 6 * math.sqrt(expected) + 3, (k, beyond[k], expected)
    assert beyond[6] <= 4  # expected n·P(|Z| > 6) = 0.03
    tail_cdf = lambda t: 1 - stats.norm.sf(t) / stats.norm.sf(4)  # noqa: E731  |Z| given |Z| > 4
    assert stats.kstest(np.concatenate(tail), tail_cdf).pvalue > 1e-4
    assert stats.kstest(generator.normals(1 << 18, CPU, torch.float32).numpy(), "norm").pvalue > 1e-4


def test_float64_gaussians_are_standard_normal():
    z = ChaCha20Generator().normals((1 << 20) + 3, CPU, torch.float64)  # not a whole number of groups
    assert z.dtype == torch.float64 and z.shape == ((1 << 20) + 3,)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    assert abs(float((z**4).mean()) - 3) < 6 * math.sqrt(96 / z.numel())


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def test_releases_ranks_and_forked_processes_never_share_or_correlate_their_noise():
    n, bound = 1 << 20, 6 / math.sqrt(1 << 20)
    source = SecretSource()
    first, second = (source.normal(torch.Size([n]), CPU, torch.float32) for _ in range(2))
    assert abs(_correlation(first, second)) < bound  # consecutive releases
    assert abs(_correlation(first[1:], first[:-1])) < bound  # neighbours within a release
    rank0, rank1 = SecretSource(), SecretSource()  # two ranks: two processes, each reading its own key
    a, b = (r.normal(torch.Size([n]), CPU, torch.float32) for r in (rank0, rank1))
    assert abs(_correlation(a, b)) < bound
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child draws from the source it inherited, mid-run
        try:
            z = source.normal(torch.Size([n]), CPU, torch.float32).numpy().tobytes()
            with os.fdopen(write, "wb") as pipe:
                pipe.write(z)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = torch.frombuffer(bytearray(pipe.read()), dtype=torch.float32)
    os.waitpid(pid, 0)
    parent = source.normal(torch.Size([n]), CPU, torch.float32)  # the parent's next draw
    assert child.shape == (n,) and not torch.equal(child, parent)
    assert abs(_correlation(child, parent)) < bound


def test_a_forked_child_reads_a_key_of_its_own(monkeypatch):
    generator = ChaCha20Generator()
    parent_key = generator._key()
    monkeypatch.setattr(chacha20.os, "getpid", lambda: -1)  # as seen from a forked child
    assert generator._key() != parent_key


def test_a_pickled_or_copied_source_carries_no_key_and_draws_its_own_numbers():
    import copy
    import pickle

    source = SecretSource()
    first = source.normal(torch.Size([64]), CPU, torch.float64)
    key = source._generator._key()
    assert key not in pickle.dumps(source)
    for twin in (pickle.loads(pickle.dumps(source)), copy.deepcopy(source)):
        assert not torch.equal(twin.normal(torch.Size([64]), CPU, torch.float64), first)
        assert twin._generator._key() != key


def test_every_draw_takes_a_new_draw_number_and_long_draws_continue_under_the_next(monkeypatch):
    """A draw longer than the block counter allows continues under the next draw number, cut between
    groups; each part is exactly the numbers of its own draw number."""
    monkeypatch.setattr(chacha20, "MAX_BLOCKS", 2 * group_blocks(torch.float64) + 5)
    generator = ChaCha20Generator()
    long = generator.normals(3 * 2 * PAIRS, CPU, torch.float64)  # 3 groups: draws 0 (2 groups) and 1
    later = generator.normals(2 * PAIRS, CPU, torch.float64)  # draw 2
    key = generator._key()
    assert np.allclose(long[:2 * PAIRS].numpy(), layout_reference(key, 0, torch.float64), rtol=1e-13)
    assert np.allclose(long[4 * PAIRS:].numpy(), layout_reference(key, 1, torch.float64), rtol=1e-13)
    assert np.allclose(later.numpy(), layout_reference(key, 2, torch.float64), rtol=1e-13)


def test_poisson_decisions_compare_64_bit_numbers_with_the_rate():
    generator = ChaCha20Generator()
    count, rate = 1000, 0.3
    included = generator.bernoulli(count, rate)  # draw number 0
    words = b"".join(reference_block(generator._key(), b, nonce_words(0)) for b in range(-(-count // 8)))
    numbers = struct.unpack(f"<{count}Q", words[:8 * count])
    assert included.tolist() == [u < math.floor(rate * 2**64) for u in numbers]
    assert not generator.bernoulli(count, 0.0).any() and generator.bernoulli(count, 1.0).all()
    share = float(generator.bernoulli(1 << 20, rate).double().mean())
    assert abs(share - rate) < 6 * math.sqrt(rate * (1 - rate) / (1 << 20))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        generator.bernoulli(3, 1.5)


def test_noise_is_made_in_the_dtype_asked_for():
    source = SecretSource()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        shapes = [torch.Size([3, 5]), torch.Size([7]), torch.Size([])]
        z = source.normals(shapes, CPU, dtype)
        assert [t.shape for t in z] == shapes and all(t.dtype == dtype for t in z)
    assert source.normals([torch.Size([0])], CPU, torch.float32)[0].numel() == 0
