"""Codecs: exactness where promised, error within each codec's bound, exact error-feedback
residuals, unbiased stochastic rounding, non-finite handling, wire-byte arithmetic.

Bounds (per element, scale = absmax(block) / qmax; see [Note: codec numerics] in codecs.py):
int8 / int4 round-to-nearest |err| <= scale / 2 (qmax 127 / 7); stochastic |err| < scale;
fp8 e4m3 |err| <= max(2^-4 |x|, 2^-10 scale) (qmax 448); blocks with a subnormal scale add up to
128 * 2^-149. A relative slack of 2^-20 covers the fp32 rounding of x / scale and q * scale.
"""

from __future__ import annotations

import math

import pytest
import torch

from overlap.compression import (
    BF16Codec,
    Encoded,
    FP8Codec,
    IdentityCodec,
    Int4Codec,
    Int8Codec,
    encode_with_feedback,
    make_grad_codec,
    make_param_codec,
    quantization_residual,
)
from overlap.kernels import num_blocks_for

SLACK = 1 + 2.0**-20
SUBNORMAL_SLACK = 128 * 2.0**-149


def quantizing_codecs(block: int = 64):
    return [Int8Codec(block), Int4Codec(block), FP8Codec(block)]


def wide_range(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 4)
    x[::7] = 0.0
    return x


def block_scales(x: torch.Tensor, block: int, qmax: float) -> torch.Tensor:
    """Per-element scale (absmax of its block / qmax), computed as the kernels do."""
    nb = num_blocks_for(x.numel(), block)
    padded = torch.nn.functional.pad(x.float(), (0, nb * block - x.numel()))
    scale = padded.view(nb, block).abs().amax(1) / qmax
    return scale.repeat_interleave(block)[: x.numel()]


def error_bound(codec, x: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    block = codec.block_size
    if isinstance(codec, FP8Codec):
        s = block_scales(x, block, 448.0)
        bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    else:
        s = block_scales(x, block, 127.0 if isinstance(codec, Int8Codec) else 7.0)
        bound = s if stochastic else s / 2
    return bound * SLACK + SUBNORMAL_SLACK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_identity_bitwise(dtype):
    x = wide_range(1001).to(dtype)
    x[3], x[4], x[5] = float("inf"), float("-inf"), float("nan")
    codec = IdentityCodec()
    enc = codec.encode(x)
    assert enc.scales is None and enc.numel == 1001 and enc.dtype == dtype
    out = codec.decode(enc)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    acc = torch.ones(1001, dtype=torch.float32)
    codec.decode_accumulate(enc, acc)
    torch.testing.assert_close(acc, 1 + x.float(), rtol=0, atol=0, equal_nan=True)


def test_bf16_exact_on_bf16_values_and_passes_nonfinite():
    x = wide_range(4096).to(torch.bfloat16).float()  # bf16-representable fp32
    x[10], x[11] = float("inf"), float("nan")
    codec = BF16Codec()
    enc = codec.encode(x)
    assert enc.codes.dtype == torch.bfloat16
    out = codec.decode(enc)
    assert out.dtype == torch.float32
    assert torch.equal(out[:10], x[:10]) and torch.equal(out[12:], x[12:])
    assert out[10] == float("inf") and out[11].isnan()
    y = torch.randn(4096)  # not representable: round-to-nearest, relative error <= 2^-8
    assert ((codec.decode(codec.encode(y)) - y).abs() <= y.abs() * 2.0**-8).all()


@pytest.mark.parametrize("block", [32, 256])
def test_quantized_error_within_bound(block):
    x = wide_range(10_000 + 3)  # not a multiple of the block
    for codec in quantizing_codecs(block):
        enc = codec.encode(x)
        err = (codec.decode(enc) - x).abs()
        bound = error_bound(codec, x)
        assert (err <= bound).all(), f"{codec}: worst excess {(err - bound).max().item()}"
        # The bound is tight for int codes: some element comes close to it.
        if not isinstance(codec, FP8Codec):
            assert (err / bound.clamp_min(1e-30)).max() > 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = wide_range(5000).clamp(-6e4, 6e4).to(dtype)
    for codec in quantizing_codecs(128):
        enc = codec.encode(x)
        out = codec.decode(enc)
        assert out.dtype == dtype and enc.dtype == dtype
        err = (codec.decode(enc, torch.float32) - x.float()).abs()
        assert (err <= error_bound(codec, x.float())).all(), str(codec)


def test_residual_reconstructs_input_exactly():
    x = wide_range(20_000 + 17, seed=1)
    x[100:164] = torch.randn(64) * 1e-39  # a block of subnormals
    x[200] = 1e-45
    for codec in quantizing_codecs(64):
        enc = codec.encode(x)
        residual = quantization_residual(codec, x, enc)
        assert residual.dtype == torch.float32
        assert torch.equal(codec.decode(enc, torch.float32) + residual, x), str(codec)


def test_error_feedback_carries_residual_over_steps():
    codec = Int8Codec(64)
    residual = torch.zeros(5000)
    sent = torch.zeros(5000, dtype=torch.float64)
    total = torch.zeros(5000, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        grad = torch.randn(5000, generator=g)
        before = residual.clone()
        enc, out = encode_with_feedback(codec, grad, residual)
        assert out is residual
        decoded = codec.decode(enc)
        assert torch.equal(decoded + residual, grad + before)  # nothing is lost
        sent += decoded.double()
        total += grad.double()
    # What was sent over all steps differs from the true sum by only the last residual.
    assert torch.allclose(sent + residual.double(), total, atol=1e-4)
    # bf16 residual buffer and the no-buffer start are accepted.
    enc, r16 = encode_with_feedback(codec, grad, torch.zeros(5000, dtype=torch.bfloat16))
    assert r16.dtype == torch.bfloat16
    enc, fresh = encode_with_feedback(codec, grad, None)
    assert fresh.dtype == torch.float32 and torch.equal(codec.decode(enc) + fresh, grad)


@pytest.mark.parametrize("codec_cls,qmax", [(Int8Codec, 127.0), (Int4Codec, 7.0)])
def test_stochastic_rounding_unbiased(codec_cls, qmax):
    block, samples = 64, 4000
    g = torch.Generator().manual_seed(4)
    pattern = torch.randn(block, generator=g)
    pattern[0] = 3.0  # fixes the absmax, so every sample has the same scale
    scale = 3.0 / qmax
    codec = codec_cls(block, stochastic=True, generator=torch.Generator().manual_seed(5))
    x = pattern.repeat(samples)  # one block per independent sample
    decoded = codec.decode(codec.encode(x)).view(samples, block)
    err = decoded - pattern
    assert (err.abs() < scale * SLACK).all()
    # Per element: the mean of `samples` draws, each with std <= scale / 2, is within 5 sigma.
    mean_err = err.double().mean(0)
    assert (mean_err.abs() <= 5 * scale / 2 / math.sqrt(samples)).all(), mean_err.abs().max()
    # Round-to-nearest on the same input is deterministic and biased for most elements.
    rtn = codec_cls(block).decode(codec_cls(block).encode(pattern)) - pattern
    assert (rtn.abs() > 5 * scale / 2 / math.sqrt(samples)).sum() > block // 2


def test_stochastic_rounding_reproducible_with_generator():
    x = torch.randn(3000)
    a = Int8Codec(128, stochastic=True, generator=torch.Generator().manual_seed(9)).encode(x)
    b = Int8Codec(128, stochastic=True, generator=torch.Generator().manual_seed(9)).encode(x)
    assert torch.equal(a.codes, b.codes)
    with pytest.raises(TypeError):
        FP8Codec(64, stochastic=True)  # type: ignore[call-arg]  # fp8 has no stochastic rounding


def test_zeros_and_subnormals():
    for codec in quantizing_codecs(64):
        zeros = torch.zeros(130)
        enc = codec.encode(zeros)
        assert torch.equal(enc.scales, torch.zeros_like(enc.scales))
        assert torch.equal(codec.decode(enc), zeros)
        tiny = torch.tensor([1e-45, -3e-45, 2e-41, 1e-39] * 40)  # subnormal fp32
        enc = codec.encode(tiny)
        assert torch.isfinite(enc.scales).all()
        err = (codec.decode(enc) - tiny).abs()
        assert (err <= error_bound(codec, tiny)).all(), str(codec)


def test_nonfinite_raises_at_the_check_or_passes_through():
    """[Note: deferred finite check]: encodes count Inf/NaN blocks without a host sync; the
    once-per-step `raise_if_nonfinite` reports them (on CPU at once) and starts a new count."""
    x = torch.randn(256)
    x[70] = float("nan")
    x[200] = float("inf")
    for codec in quantizing_codecs(64):
        out = codec.decode(codec.encode(x))  # no error here: the blocks travel as NaN
        assert out[64:128].isnan().all() and out[192:].isnan().all()
        codec.encode(torch.randn(100))  # a clean encode in the same step
        with pytest.raises(ValueError, match=r"Inf or NaN in 2 of 6 blocks of 64 \(2 encodes"):
            codec.raise_if_nonfinite()
        codec.raise_if_nonfinite()  # counted once: the next step starts from zero
        residual = torch.zeros(256)
        codec.encode_feedback(x, residual)  # the error-feedback path counts too
        with pytest.raises(ValueError, match="Inf or NaN in 2 of 4 blocks"):
            codec.raise_if_nonfinite(wait=True)
    for cls in (Int8Codec, Int4Codec, FP8Codec):
        codec = cls(64, check_finite=False)
        out = codec.decode(codec.encode(x))
        assert out[64:128].isnan().all() and out[192:].isnan().all()  # whole blocks, loudly
        assert torch.isfinite(out[:64]).all() and torch.isfinite(out[128:192]).all()
        codec.raise_if_nonfinite()  # not counted
    codec = Int8Codec(64)
    with torch.inference_mode():  # e.g. an evaluation forward encodes the parameters first
        codec.encode(x)
    codec.encode(x)  # the count is a normal tensor: training may update it afterwards
    with pytest.raises(ValueError, match="Inf or NaN in 4 of 8 blocks"):
        codec.raise_if_nonfinite()
    for codec in (IdentityCodec(), BF16Codec()):  # they carry Inf/NaN: nothing to report
        codec.encode(x)
        codec.raise_if_nonfinite()


class _FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class _FakeEvent:
    """Done or not as `_FakeEvent.done` says; counts the queries and the waits."""

    done = True
    queries = 0
    waits = 0

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        _FakeEvent.queries += 1
        return _FakeEvent.done

    def synchronize(self) -> None:
        _FakeEvent.waits += 1


def test_nonfinite_cuda_path_reports_two_checks_late(monkeypatch):
    """The CUDA branch of [Note: deferred finite check], with CPU tensors standing in for
    device ones and fake streams / events: counts per stream, sent at one check, reported two
    checks later (a fixed step, the same on every rank), asking the event first and waiting only
    if its copy is not done; `wait=True` reads everything at once. No host read at encode time."""
    from contextlib import nullcontext

    from overlap.compression import finite

    _FakeEvent.done, _FakeEvent.queries, _FakeEvent.waits = True, 0, 0
    streams = [_FakeStream(1), _FakeStream(2)]
    current = {"stream": streams[0]}
    monkeypatch.setattr(finite, "_stream_of", lambda device: current["stream"])
    monkeypatch.setattr(finite, "_pinned_float64", lambda: torch.zeros(1, dtype=torch.float64))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    bad = torch.randn(128)
    bad[5] = float("nan")
    codec = Int8Codec(64)
    codec.encode(bad)  # step 1: one bad block on each stream
    current["stream"] = streams[1]
    codec.encode(bad)
    codec.raise_if_nonfinite()  # end of step 1: sends both counts, reports nothing yet
    codec.encode(torch.randn(128))  # step 2: clean
    codec.raise_if_nonfinite()  # end of step 2: step 1's copies are done, but not due
    assert (_FakeEvent.queries, _FakeEvent.waits) == (0, 0)
    with pytest.raises(ValueError, match=r"Inf or NaN in 2 of 4 blocks of 64 \(2 encodes"):
        codec.raise_if_nonfinite()  # end of step 3: step 1's counts are due
    assert (_FakeEvent.queries, _FakeEvent.waits) == (2, 0)  # asked, already done: no wait
    codec.raise_if_nonfinite()  # end of step 4: step 2 was clean
    assert codec.nonfinite is not None and codec.nonfinite.blocking_waits == 0
    codec.encode(bad)  # step 5, and the device two steps behind at step 7
    codec.raise_if_nonfinite()
    codec.raise_if_nonfinite()
    _FakeEvent.done = False
    with pytest.raises(ValueError, match="Inf or NaN in 1 of 2 blocks"):
        codec.raise_if_nonfinite()
    assert _FakeEvent.waits == 1 and codec.nonfinite.blocking_waits == 1
    codec.encode(bad)
    with pytest.raises(ValueError, match="Inf or NaN in 1 of 2 blocks"):
        codec.raise_if_nonfinite(wait=True)  # read at once
    codec.raise_if_nonfinite()
    codec.raise_if_nonfinite()


def test_agreed_count_replaces_the_local_one():
    """[Note: collective finite check]: once a step has a count summed over every rank (the
    largest of those handed over: the last bucket's, which covers the others), the check
    reports it, on every rank alike, instead of this rank's own count; the next step starts
    from zero."""
    codec = Int8Codec(64)
    bad = torch.randn(128)
    bad[5] = float("nan")
    codec.encode(bad)  # this rank: 1 bad block
    codec.agree_nonfinite(torch.tensor([1.0]))  # bucket 1: every rank so far
    codec.agree_nonfinite(torch.tensor([3.0], dtype=torch.bfloat16))  # bucket 2: another rank's too
    with pytest.raises(ValueError, match=r"Inf or NaN in 3 blocks of 64, counted over every rank"):
        codec.raise_if_nonfinite()
    codec.raise_if_nonfinite()
    codec.encode(torch.randn(128))
    codec.agree_nonfinite(torch.zeros(1))  # a clean step everywhere
    codec.raise_if_nonfinite()
    codec.encode(bad)  # no collective this step: the local count
    with pytest.raises(ValueError, match="Inf or NaN in 1 of 2 blocks"):
        codec.raise_if_nonfinite()


def test_decode_accumulate_sums_in_fp32():
    x = torch.randn(3000)
    for codec in [IdentityCodec(), BF16Codec(), *quantizing_codecs(128)]:
        enc = codec.encode(x)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.randn(3000).to(dtype)
            expected = (out.float() + codec.decode(enc, torch.float32)).to(dtype)
            codec.decode_accumulate(enc, out)
            assert torch.equal(out, expected), f"{codec} into {dtype}"
        with pytest.raises(ValueError, match="contiguous"):
            codec.decode_accumulate(enc, torch.zeros(10))


def test_wire_bytes_and_byte_roundtrip():
    assert IdentityCodec().wire_bytes(1000) == 4000
    assert IdentityCodec().wire_bytes(1000, torch.bfloat16) == 2000
    assert BF16Codec().wire_bytes(1000) == 2000
    assert Int8Codec(256).wire_bytes(1000) == 4 * 256 + 4 * 4  # padded codes + fp32 scales
    assert Int4Codec(128).wire_bytes(1000) == 8 * 64 + 8 * 4
    assert FP8Codec(256).wire_bytes(1024) == 1024 + 16
    n = 1 << 20
    assert 4 * n / Int8Codec().wire_bytes(n) >= 3.5
    assert 4 * n / Int4Codec().wire_bytes(n) >= 7.0
    x = torch.randn(1000)
    for codec in [IdentityCodec(), BF16Codec(), *quantizing_codecs(256)]:
        enc = codec.encode(x)
        buf = codec.to_bytes(enc)
        assert buf.dtype == torch.uint8 and buf.numel() == codec.wire_bytes(1000), str(codec)
        back = codec.from_bytes(buf.clone(), 1000, torch.float32)
        assert isinstance(back, Encoded)
        assert torch.equal(codec.decode(back), codec.decode(enc)), str(codec)


def test_aligned_chunks_encode_independently():
    """Encoding a rank-major buffer once equals encoding each aligned destination chunk."""
    world, chunk = 4, 3 * 128
    x = wide_range(world * chunk, seed=7)
    for codec in quantizing_codecs(128):
        assert chunk % codec.alignment_numel == 0
        whole = codec.encode(x)
        codes = whole.codes.chunk(world)
        scales = whole.scales.chunk(world)
        for r in range(world):
            part = codec.encode(x[r * chunk : (r + 1) * chunk])
            assert torch.equal(part.codes, codes[r]) and torch.equal(part.scales, scales[r])


def test_factories():
    assert isinstance(make_param_codec(None), IdentityCodec)
    assert isinstance(make_grad_codec(None), IdentityCodec)
    assert make_param_codec("bf16").name == "bf16" and make_grad_codec("bf16").name == "bf16"
    assert isinstance(make_param_codec("int8"), Int8Codec)
    assert isinstance(make_param_codec("fp8", block_size=128), FP8Codec)
    grad = make_grad_codec("int4", block_size=64, stochastic=True, generator=torch.Generator())
    assert isinstance(grad, Int4Codec) and grad.stochastic and grad.block_size == 64
    assert make_grad_codec("int8").name == "int8"
    with pytest.raises(ValueError, match="param_compression"):
        make_param_codec("int4")
    with pytest.raises(ValueError, match="grad_compression"):
        make_grad_codec("fp8")
    with pytest.raises(ValueError, match="block_size"):
        Int4Codec(7)


def test_chunk_bytes_for_all_to_all_and_all_gather():
    """The byte layouts the collectives use: one uint8 buffer, chunk r at r * wire_bytes(chunk)."""
    world, chunk = 4, 2 * 256
    x = wide_range(world * chunk, seed=8)
    for codec in [IdentityCodec(), BF16Codec(), *quantizing_codecs(256)]:
        step = codec.wire_bytes(chunk)
        # Reduce-scatter by all-to-all: one encode of the rank-major buffer, chunk-major bytes.
        buf = codec.to_chunk_bytes(codec.encode(x), world)
        assert buf.numel() == world * step
        parts = codec.from_chunk_bytes(buf.clone(), world, chunk, torch.float32)
        for r, part in enumerate(parts):
            expected = codec.decode(codec.encode(x[r * chunk : (r + 1) * chunk]))
            out = torch.empty(chunk)
            assert torch.equal(codec.decode_into(part, out), expected), str(codec)
        # All-gather: each rank's to_bytes(encode(shard)), concatenated, splits the same way.
        gathered = torch.cat([codec.to_bytes(codec.encode(x[r * chunk : (r + 1) * chunk])) for r in range(world)])
        assert torch.equal(gathered, buf), str(codec)
        with pytest.raises(ValueError, match="chunks"):
            codec.to_chunk_bytes(codec.encode(x[:-2]), world)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nonfinite_on_cuda_reported_two_steps_late_without_sync():
    x = torch.randn(256, device="cuda")
    x[70] = float("nan")
    codec = Int8Codec(64)
    codec.encode(torch.randn(256, device="cuda"))  # warm up, then start from an empty count
    codec.raise_if_nonfinite(wait=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        codec.encode(x)  # step 1
        codec.raise_if_nonfinite()  # sends step 1's count, reports nothing yet
        codec.encode(torch.randn(256, device="cuda"))  # step 2
    finally:
        torch.cuda.set_sync_debug_mode("default")
    codec.raise_if_nonfinite()  # end of step 2: step 1's count is not due yet
    with pytest.raises(ValueError, match="Inf or NaN in 1 of 4 blocks"):
        codec.raise_if_nonfinite()  # end of step 3: it is
    codec.raise_if_nonfinite()
    codec.raise_if_nonfinite()
    codec.encode(x)
    with pytest.raises(ValueError, match="Inf or NaN in 1 of 4 blocks"):
        codec.raise_if_nonfinite(wait=True)
