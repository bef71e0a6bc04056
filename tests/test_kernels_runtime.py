"""kernels/runtime.py: the launch cache keys on what Triton specializes on, and a cached launch
computes what a launch through Triton computes (new data, other alignments, another stream)."""

import pytest
import torch

from nvfp4_recipe.kernels.quantize import quantize_1d
from nvfp4_recipe.kernels.runtime import _arg_key
from nvfp4_recipe.reference import quantize

from nvfp4_cases import assert_same, spec


def test_arg_key_separates_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) == _arg_key(torch.ones(64))
    assert _arg_key(base) != _arg_key(base[1:])  # 16-byte alignment
    assert _arg_key(base) != _arg_key(base.half())
    assert _arg_key(1) != _arg_key(2) != _arg_key(16)
    assert _arg_key(16) == _arg_key(32)
    assert _arg_key(2**31) != _arg_key(2**31 - 16)  # int64 vs int32 argument
    assert _arg_key(True) != _arg_key(False)
    assert _arg_key(0.5) == _arg_key(2.0)


@pytest.mark.cuda
def test_cached_launches_match_the_reference():
    """The first launch per key goes through Triton, the next ones through the cache: each call
    here (fresh data, an offset view with other alignment, a side stream) must still give the
    reference's bits."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    sp = spec(scaling="per_token", rounding="sr")
    side = torch.cuda.Stream()
    for step in range(4):
        buf = torch.randn(256 * 272 + 8, device="cuda", generator=gen)
        x = (buf[8:] if step % 2 else buf[:-8]).view(256, 272)
        with torch.cuda.stream(side if step == 3 else torch.cuda.current_stream()):
            got = quantize_1d(x, row=sp, seed=step, row_offset=16 * step)[0]
        torch.cuda.synchronize()
        assert_same(got, quantize(x, sp, seed=step, offset=16 * step))


def test_ensure_allocator_sets_one_per_thread_and_keeps_the_users():
    """Triton keeps its allocator in a ContextVar: a thread without one (autograd's backward
    thread) gets the package's, which hands out torch scratch; a user's allocator stays."""
    import threading

    import triton
    from triton.runtime import _allocation

    from nvfp4_recipe.kernels.runtime import _scratch, ensure_allocator

    def fresh_thread(fn):
        out = {}
        t = threading.Thread(target=lambda: out.update(result=fn()))
        t.start()
        t.join()
        return out["result"]

    def set_in_fresh_thread():
        assert _allocation._allocator.get() is _allocation._NULL_ALLOCATOR
        ensure_allocator()
        return _allocation._allocator.get()

    assert fresh_thread(set_in_fresh_thread) is _scratch

    def users_kept():
        def mine(size, align, stream):
            return torch.empty(size, dtype=torch.int8)
        triton.set_allocator(mine)
        ensure_allocator()
        return _allocation._allocator.get() is mine

    assert fresh_thread(users_kept)
    if torch.cuda.is_available():
        buf = _scratch(384, 128, None)
        assert buf.numel() == 384 and buf.is_cuda and buf.data_ptr() % 128 == 0
