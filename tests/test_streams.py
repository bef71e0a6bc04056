"""The side stream NVFP4Linear quantizes its weight on (``nvfp4_recipe.streams``)."""

import copy

import pytest
import torch

from nvfp4_recipe import NVFP4Linear, NVFP4Recipe, backends
from nvfp4_recipe.streams import SideStream

SLEEP = 50_000_000  # GPU clock cycles (tens of ms): long enough for any race to show


def test_off_cuda_the_body_runs_inline():
    x = torch.ones(4)
    with SideStream(x.device) as side:
        y = x + 1
    side.join(y)
    assert torch.equal(y, torch.full((4,), 2.0))


@pytest.mark.cuda
def test_fork_waits_for_the_current_stream_and_join_for_the_side(device):
    user = torch.cuda.Stream(device)  # a non-default current stream: the fork starts from it
    with torch.cuda.stream(user):
        x = torch.zeros(1 << 20, device=device)
        torch.cuda._sleep(SLEEP)
        x.fill_(2.0)
        with SideStream(device) as side:
            y = x + 1  # must see the fill queued before the fork
            torch.cuda._sleep(SLEEP)
            y.mul_(2.0)
        side.join(y)
        z = y + 1  # must see the side stream's last write
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 7.0))


@pytest.mark.cuda
def test_layer_on_side_stream_matches_one_stream(device, monkeypatch):
    """The same bits with the weight quantized on the side stream as on one stream, from a
    non-default current stream, over two steps (the SR step advances)."""
    torch.manual_seed(0)
    layer = NVFP4Linear(1024, 2048, recipe=NVFP4Recipe(), device=device)
    x = torch.randn(8192, 1024, device=device, dtype=torch.bfloat16)
    dy = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)

    def steps(model):
        out = []
        with torch.cuda.stream(torch.cuda.Stream(device)):
            for _ in range(2):
                xi = x.clone().requires_grad_()
                model.zero_grad(set_to_none=True)
                y = model(xi)
                y.backward(dy)
                out += [y.detach(), xi.grad, model.weight.grad, model.bias.grad]
        torch.cuda.synchronize()
        return out

    forked = steps(copy.deepcopy(layer))
    monkeypatch.setattr(backends, "SideStream", lambda dev: SideStream(torch.device("cpu")))
    inline = steps(copy.deepcopy(layer))
    for a, b in zip(forked, inline):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
