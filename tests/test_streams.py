"""The side stream NVFP4Linear quantizes its weight on (``nvfp4_recipe.streams``), which forks
only while a CUDA graph is captured."""

import copy

import pytest
import torch

from nvfp4_recipe import NVFP4Linear, NVFP4Recipe
from nvfp4_recipe.backends import triton as triton_backend
from nvfp4_recipe.streams import SideStream

SLEEP = 20_000_000  # GPU clock cycles (about 10 ms): long enough for a race to show


def test_without_capture_the_body_runs_inline():
    x = torch.ones(4)
    with SideStream(x.device) as side:
        y = x + 1
    side.join(y)
    assert torch.equal(y, torch.full((4,), 2.0))


def captured(fn, device):
    """fn() warmed up on a side stream, then captured in a CUDA graph; returns the graph."""
    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.cuda
def test_fork_waits_for_the_current_stream_and_join_for_the_side(device):
    x = torch.zeros(1 << 20, device=device)
    z = torch.empty_like(x)
    forked = []

    def fn():
        x.zero_()
        torch.cuda._sleep(SLEEP)
        x.fill_(2.0)
        before = torch.cuda.current_stream(device)
        with SideStream(device) as side:
            forked.append(torch.cuda.current_stream(device) != before)
            y = x + 1  # must see the fill queued before the fork
            torch.cuda._sleep(SLEEP)
            y.mul_(2.0)
        side.join(y)
        z.copy_(y + 1)  # must see the side stream's last write

    graph = captured(fn, device)
    assert forked == [False, False, True]  # inline in eager warm-up, forked in the capture
    z.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 7.0))


@pytest.mark.cuda
def test_layer_with_side_stream_matches_one_stream(device, monkeypatch):
    """A captured NVFP4Linear fwd+bwd gives the same bits with the weight quantized on the side
    stream as on one stream, over two replays (the SR step advances)."""
    torch.manual_seed(0)
    layer = NVFP4Linear(1024, 2048, recipe=NVFP4Recipe(), device=device)
    x = torch.randn(8192, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)

    def replays(model):
        out = []

        def step():
            x.grad = None
            model.weight.grad = model.bias.grad = None
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                out.append(model(x))
            out[-1].backward(dy)

        graph = captured(step, device)
        results = []
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            results += [t.clone() for t in (out[-1], x.grad, model.weight.grad, model.bias.grad)]
        return results

    forked = replays(copy.deepcopy(layer))
    monkeypatch.setattr(triton_backend, "SideStream", lambda dev: SideStream(torch.device("cpu")))
    inline = replays(copy.deepcopy(layer))
    assert not torch.equal(forked[2], forked[6])  # a new SR stream on the second replay
    for a, b in zip(forked, inline):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
