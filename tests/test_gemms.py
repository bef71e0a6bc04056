"""The layer algorithm of ``gemms.py`` in its two layouts: a dense layer is one group, so a
grouped call with one group and one expert runs the same three GEMMs on the same operands."""

import pytest
import torch

import nvfp4_recipe as nr
from nvfp4_recipe import gemms
from nvfp4_recipe.backends import get_backend
from nvfp4_cases import INTERPRETING, backend_device, rand


def run(layout, w, recipe, backend, x, dy):
    """(Y, dX, dW) of :class:`gemms.GemmsFn` under ``layout`` with the SR stream (1234, step 0)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    sr = (torch.tensor(1234, device=x.device), torch.tensor(0, device=x.device), 0)
    y = gemms.GemmsFn.apply(x, w, None, recipe.signs().to(x.device), sr, recipe, backend, x.dtype,
                            layout)
    y.backward(dy)
    return y, x.grad, w.grad


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fields", [{}, dict(scaling="per_token"),
                                    dict(backward_override="dequantized")],
                         ids=["default", "per_token", "bwd_dequantized"])
def test_dense_layer_is_one_group(backend, fields):
    """Y, dX and dW of the dense layout equal those of the grouped layout with one group of all
    the tokens and one expert (the weight with a leading dim of 1): bit for bit on the reference
    backend; on the Triton backend up to the fp32 summation order of its (grouped) GEMMs (the
    Triton backend on ``kernel_device``: the interpreter on CPU tensors, compiled on a GPU)."""
    recipe = nr.NVFP4Recipe(backend=backend, **fields)
    dev = backend_device(backend)
    name = get_backend(backend, dev).name
    x, w = rand((48, 64), device=dev, seed=1), rand((32, 64), torch.float32, dev, seed=2)
    dy = rand((48, 32), device=dev, seed=3)
    dense = run(gemms.Dense(), w, recipe, name, x, dy)
    offs = torch.tensor([48], dtype=torch.int32, device=dev)
    grouped = run(gemms.Grouped(offs), w[None], recipe, name, x, dy)
    for a, b in zip(dense, grouped):
        b = b.reshape(a.shape)
        if backend == "reference":
            assert torch.equal(a, b)
            continue
        tol = 1e-6 * a.float().abs().max()
        if not INTERPRETING and a.dtype != torch.float32:
            # compiled, the dense GEMM and the grouped one are different kernels: their fp32 sums
            # may differ in the last bits and round a 16-bit output to its neighbour (2**-7 of it)
            tol = tol + 2.0**-7 * a.float().abs()
        assert ((a.float() - b.float()).abs() <= tol).all()
