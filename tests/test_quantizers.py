"""The operand quantizers of a layer call (``quantizers.build``): which exist for each usage,
their specs from the recipe, the RHT signs, the SR stream and counters (a tensor-parallel shard's
shift included) and the amax reducers."""

import pytest
import torch

import nvfp4_recipe as nr
from nvfp4_recipe import quantizers
from nvfp4_recipe.quantizers import FPROP_ONLY, Usage
from nvfp4_recipe.recipe import SR_OFFSETS
from nvfp4_recipe.spec import GemmRole
from nvfp4_recipe.tensor_parallel import TensorParallelShard

R = GemmRole


def roles(t):
    """(rowwise role, columnwise role) of a TensorQuantizer, None for an absent copy."""
    return tuple(None if q is None else q.role for q in t)


@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("wgrad", [False, True])
def test_forward_quantizers_follow_usage(dgrad, wgrad):
    """Forward: X rowwise (fprop's A) and, with wgrad, X columnwise (X^T); W rowwise and, with
    dgrad, its columnwise W^T under W's spec; each spec the recipe's, the signs only on an RHT
    operand, round to nearest (seed and offset 0); only the saved copies are not fprop-only."""
    recipe, signs = nr.NVFP4Recipe(), torch.ones(16)
    q = quantizers.build(recipe, signs, Usage(dgrad, wgrad))
    assert q.dy is None
    assert roles(q.x) == (R.X_FPROP, R.X_WGRAD if wgrad else None)
    assert roles(q.w) == (R.W_FPROP, R.W_FPROP if dgrad else None)
    for t in (q.x, q.w):
        for op in t:
            if op is None:
                continue
            assert op.spec == recipe.spec(op.role)
            assert (op.signs is signs) == op.spec.rht
            assert (op.seed, op.offset, op.amax_reduce) == (0, 0, None)
    assert q.x.rowwise.gemm_only and q.w.rowwise.gemm_only
    assert not any(op.gemm_only for op in (q.x.columnwise, q.w.columnwise) if op is not None)
    assert quantizers.build(recipe, signs, FPROP_ONLY) == quantizers.build(recipe, signs,
                                                                           Usage(False, False))


def test_keep_and_forward_override():
    """``keep`` (a dequantized backward) makes fprop's X and W more than fprop-only; a
    ``forward_override`` leaves X no rowwise quantizer (fprop in high precision)."""
    signs = torch.ones(16)
    q = quantizers.build(nr.NVFP4Recipe(), signs, Usage(True, True, keep=True))
    assert not q.x.rowwise.gemm_only and not q.w.rowwise.gemm_only
    q = quantizers.build(nr.NVFP4Recipe(forward_override="high_precision"), signs,
                         Usage(True, True, keep=True))
    assert roles(q.x) == (None, R.X_WGRAD) and q.w.rowwise.gemm_only


@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("wgrad", [False, True])
def test_backward_quantizers_follow_usage(dgrad, wgrad):
    """Backward: dY rowwise with dgrad, columnwise with wgrad, both on the step's SR key from
    ``SR_OFFSETS``, both for their GEMMs only; no X or W quantizers."""
    recipe, signs, key = nr.NVFP4Recipe(), torch.ones(16), torch.tensor(7)
    q = quantizers.build(recipe, signs, Usage(dgrad, wgrad), None, (64, 32), key)
    assert q.x is None and q.w is None
    assert roles(q.dy) == (R.DY_DGRAD if dgrad else None, R.DY_WGRAD if wgrad else None)
    for op in q.dy:
        if op is not None:
            assert op.spec == recipe.spec(op.role) and (op.signs is signs) == op.spec.rht
            assert op.seed is key and op.offset == SR_OFFSETS[op.role] and op.gemm_only


def test_tensor_parallel_shard():
    """A colwise shard: dY's SR counters shifted past the earlier shards' blocks (rank x rows x
    cols / 16 of each copy's local shape), W's amax reduced over the group, the replicated X's
    not; a rowwise shard leaves the replicated dY's counters where they are."""
    recipe, signs, (m, n) = nr.NVFP4Recipe(), torch.ones(16), (64, 32)
    shard = TensorParallelShard("colwise", None, 2)
    dy = quantizers.build(recipe, signs, Usage(True, True), shard, (m, n), 0).dy
    assert dy.rowwise.offset == SR_OFFSETS[R.DY_DGRAD] + 2 * m * (n // 16)
    assert dy.columnwise.offset == SR_OFFSETS[R.DY_WGRAD] + 2 * n * (m // 16)
    assert dy.rowwise.amax_reduce is not None and dy.columnwise.amax_reduce is not None
    fwd = quantizers.build(recipe, signs, Usage(True, True), shard)
    assert fwd.w.rowwise.amax_reduce is not None and fwd.w.columnwise.amax_reduce is not None
    assert fwd.x.rowwise.amax_reduce is None and fwd.x.columnwise.amax_reduce is None
    rowwise = TensorParallelShard("rowwise", None, 1)
    dy = quantizers.build(recipe, signs, Usage(True, True), rowwise, (m, n), 0).dy
    assert (dy.rowwise.offset, dy.columnwise.offset) == (SR_OFFSETS[R.DY_DGRAD],
                                                         SR_OFFSETS[R.DY_WGRAD])
    assert dy.rowwise.amax_reduce is None and dy.columnwise.amax_reduce is None


def test_inspected_copies_are_codes_with_the_same_quantization():
    """inspect records every copy as codes: inspected() turns gemm_only off and keeps the rest."""
    signs = torch.ones(16)
    dy = quantizers.build(nr.NVFP4Recipe(), signs, Usage(True, True), dy=(32, 48), sr_key=7).dy
    assert dy.rowwise.gemm_only and dy.columnwise.gemm_only
    for before, after in zip(dy, quantizers.inspected(dy)):
        assert not after.gemm_only
        assert after.signs is before.signs
        assert after._replace(gemm_only=True, signs=None) == before._replace(signs=None)
    assert quantizers.inspected(quantizers.TensorQuantizer(dy.rowwise, None)).columnwise is None
