"""The side stream the Triton backend prepares weights on (``nvfp4_recipe.streams``), which forks
only while a CUDA graph is captured, and its joins: every primitive joins the forks whose outputs
it reads before it launches anything.

On the CPU a fork is simulated by :class:`RacingSide`: its outputs hold NaN bits until they are
joined, as a side stream's unfinished results would, so a consumer that reads them unjoined
computes wrong values. The ``cuda`` tests capture real graphs and compare their replays with one
stream and with eager mode."""

import copy
import threading

import pytest
import torch

from nvfp4_recipe import NVFP4Linear, NVFP4Recipe, moe, streams
from nvfp4_recipe.backends import Backend
from nvfp4_recipe.backends import triton as triton_backend
from nvfp4_recipe.spec import GemmRole
from nvfp4_recipe.streams import SideStream, join_reads

from nvfp4_cases import rand, triton_backend as backend_on

SLEEP = 20_000_000  # GPU clock cycles (about 10 ms): long enough for a race to show
RECIPE = NVFP4Recipe()


class RacingSide(SideStream):
    """A fork taken without a CUDA stream: the body runs inline, and what :meth:`defer_join` is
    given holds NaN bits (all ones: NaN in every float format, codes of -6) until :meth:`join`."""

    forked = True

    def __init__(self, device=None):
        super().__init__(torch.device("cpu"))
        self._unfinished = []

    def defer_join(self, *outputs) -> None:
        for t in streams._tensors(outputs):
            self._unfinished.append((t, t.clone()))
            (t.unsqueeze(0) if t.dim() == 0 else t).view(torch.uint8).fill_(0xFF)
        super().defer_join(*outputs)

    def join(self, *outputs) -> None:
        for t, value in reversed(self._unfinished):  # a tensor deferred twice: its first copy
            t.copy_(value)
        self._unfinished.clear()


@pytest.fixture
def deferred_forks(monkeypatch):
    """A fresh list of deferred forks (one a failing test leaves unjoined stays there)."""
    monkeypatch.setattr(streams, "_DEFERRED", [])
    return streams._DEFERRED


def deferred(*outputs):
    """``outputs`` as a fork's (:class:`RacingSide`), joined where they are read."""
    RacingSide().defer_join(*outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def flat(result):
    """The tensors (and Nones) of a primitive's result, in order."""
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in flat(r)]
    return [result]


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_bits(got, want):
    """Results of one structure, their tensors equal bit for bit and other fields equal."""
    got, want = flat(got), flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        else:
            assert a == b


def operands(be, device):
    """Fresh inputs of the primitives: a dense layer (X (32, 64), W (48, 64), dY (32, 48)) and
    two experts (W (2, 32, 48), X (64, 48) in groups of 16 and 48 tokens, dY (64, 32))."""
    seed = int(torch.randint(1 << 30, ()))
    signs = RECIPE.signs().to(device)
    x, w, dy = (rand(s, device=device, seed=seed + i) for i, s in
                enumerate(((32, 64), (48, 64), (32, 48))))
    wq, wtq = be.prepare_weight(w, RECIPE.spec(GemmRole.W_FPROP), need_t=True)
    we, xe, dye = (rand(s, device=device, seed=seed + 3 + i) for i, s in
                   enumerate(((2, 32, 48), (64, 48), (64, 32))))
    offs = torch.tensor([16, 64], dtype=torch.int32, device=device)
    weq, wetq = be.quantize_experts(we, RECIPE.spec(GemmRole.W_FPROP), need_t=True)
    return dict(x=x, w=w, dy=dy, signs=signs, wq=wq, wtq=wtq,
                xq=be.quantize(x, RECIPE.spec(GemmRole.X_FPROP)),
                dyq=be.quantize(dy, RECIPE.spec(GemmRole.DY_DGRAD)),
                xtq=be.quantize(x.t(), RECIPE.spec(GemmRole.X_WGRAD), signs=signs),
                we=we, xe=xe, dye=dye, offs=offs, weq=weq, wetq=wetq,
                xeq=be.quantize_groups(xe, offs, RECIPE.spec(GemmRole.X_FPROP), None)[0])


# each primitive of the backend with one input made by a fork (``defer``): the operand it reads
# as a GEMM's B, the one it prepares (and dgrad's GEMM on it: a prepared operand comes back as
# codes on one stream, as inner values from a fork), or the high-precision tensor it quantizes
DY_PAIR = dict(row=RECIPE.spec(GemmRole.DY_DGRAD), col=RECIPE.spec(GemmRole.DY_WGRAD))
CASES = {
    "quantize": lambda be, d, o: be.quantize(d(o["x"]), RECIPE.spec(GemmRole.X_FPROP)),
    "quantize_pair": lambda be, d, o: be.quantize_pair(o["dy"], **DY_PAIR, signs=o["signs"],
                                                       prepare=d(o["xtq"])),
    "prepare_weight": lambda be, d, o: be.prepare_weight(d(o["w"]), RECIPE.spec(GemmRole.W_FPROP),
                                                         need_t=True),
    "prepare": lambda be, d, o: be.mm(o["dyq"], be.prepare(d(o["wtq"]))),
    "transpose_2d": lambda be, d, o: be.transpose_2d(d(o["wtq"])),
    "mm": lambda be, d, o: be.mm(o["xq"], d(o["wq"])),
    "quantize_groups": lambda be, d, o: be.quantize_groups(o["dye"], o["offs"], **DY_PAIR,
                                                           signs=o["signs"], prepare=d(o["wetq"])),
    "quantize_experts": lambda be, d, o: be.quantize_experts(d(o["we"]), RECIPE.spec(GemmRole.W_FPROP),
                                                             need_t=True, transient=True),
    "grouped_mm": lambda be, d, o: be.grouped_mm(o["xeq"], d(o["weq"])),
}


def test_the_cases_cover_every_primitive():
    assert sorted(CASES) == sorted(Backend.PRIMITIVES)


@pytest.mark.parametrize("primitive", sorted(CASES))
def test_a_primitive_joins_the_forks_it_reads(primitive, kernel_device, deferred_forks,
                                              monkeypatch):
    """A primitive given a fork's output reads it joined: the bits of one stream. Its own forks
    (``prepare_weight``, ``prepare``) are joined by the reader of its result, here the test."""
    be = backend_on(kernel_device)
    inputs = operands(be, kernel_device)
    want = copy.deepcopy(CASES[primitive](be, lambda t: t, inputs))
    monkeypatch.setattr(triton_backend, "SideStream", RacingSide)
    got = CASES[primitive](be, deferred, inputs)
    join_reads(got)
    assert not deferred_forks
    assert_same_bits(got, want)


def test_a_primitive_that_reads_no_fork_does_not_join(kernel_device, deferred_forks):
    """The activations' quantization beside a deferred weight does not wait for it."""
    be = backend_on(kernel_device)
    o = operands(be, kernel_device)
    deferred(o["wq"])
    be.quantize_pair(o["x"], RECIPE.spec(GemmRole.X_FPROP), RECIPE.spec(GemmRole.X_WGRAD),
                     signs=o["signs"])
    assert len(deferred_forks) == 1
    be.mm(o["xq"], o["wq"])
    assert not deferred_forks


def test_a_fork_is_joined_by_a_reader_on_another_thread(kernel_device, deferred_forks):
    """Autograd runs a CUDA backward on its own thread: a fork of the forward read there first
    (W^T of a forward in high precision, read by dgrad) is joined there."""
    be = backend_on(kernel_device)
    o = operands(be, kernel_device)
    want = be.mm(o["xq"], o["wq"])
    deferred(o["wq"])
    got = []
    reader = threading.Thread(target=lambda: got.append(be.mm(o["xq"], o["wq"])))
    reader.start()
    reader.join()
    assert torch.equal(got[0], want)


def linear_step(recipe, device):
    """A step of an NVFP4Linear (64 -> 48) on a batch of 32: (y, dX, dW, db) with dY of ones."""
    torch.manual_seed(1)
    layer = NVFP4Linear(64, 48, recipe=recipe, device=device)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    return y, x.grad, layer.weight.grad, layer.bias.grad


def grouped_step(recipe, device):
    """A step of a grouped linear (two experts, 48 -> 32, groups of 16 and 48 tokens)."""
    torch.manual_seed(1)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    w = torch.randn(2, 32, 48, device=device, requires_grad=True)
    offs = torch.tensor([16, 64], dtype=torch.int32, device=device)
    sr = (torch.tensor(5, device=device), torch.tensor(0, device=device))
    y = moe.grouped_linear(x, w, offs, recipe, recipe.signs().to(device), *sr)
    y.backward(torch.ones_like(y))
    return y, x.grad, w.grad


@pytest.mark.parametrize("step,recipe", [
    (linear_step, NVFP4Recipe(backend="triton")),
    (linear_step, NVFP4Recipe(backend="triton", forward_override="high_precision")),
    (grouped_step, NVFP4Recipe(backend="triton")),
], ids=["linear", "linear-fprop-high-precision", "grouped"])
def test_a_layer_step_with_forks_matches_one_stream(step, recipe, kernel_device, deferred_forks,
                                                    monkeypatch):
    """Every fork a layer's forward and backward take is joined before it is read, and none is
    left pending after the step."""
    want = step(recipe, kernel_device)
    monkeypatch.setattr(triton_backend, "SideStream", RacingSide)
    got = step(recipe, kernel_device)
    assert not deferred_forks
    assert_same_bits(got, want)


def test_without_capture_the_body_runs_inline(deferred_forks):
    x = torch.ones(4)
    with SideStream(x.device) as side:
        y = x + 1
    assert not side.forked
    side.defer_join(y)
    assert not deferred_forks
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
def test_deferred_join_waits_where_the_output_is_read(device, deferred_forks):
    """A deferred fork is joined by the first reader of its output, not before, in the graph."""
    x = torch.zeros(1 << 20, device=device)
    z = torch.empty_like(x)
    joined = []

    def fn():
        x.fill_(2.0)
        with SideStream(device) as side:
            y = x + 1
            torch.cuda._sleep(SLEEP)
            y.mul_(2.0)
        side.defer_join(y)
        join_reads(x)  # reads no output of the fork
        joined.append(not deferred_forks)
        join_reads((None, [y]))
        joined.append(not deferred_forks)
        z.copy_(y + 1)

    graph = captured(fn, device)
    assert joined == [True, True, True, True, False, True]
    z.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 7.0))


def replays(step, outputs, device, n=2):
    """The tensors ``outputs()`` names after each of n replays of ``step`` captured in a graph."""
    graph = captured(step, device)
    results = []
    for _ in range(n):
        graph.replay()
        torch.cuda.synchronize()
        results += [t.clone() for t in outputs()]
    return results


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [NVFP4Recipe(), NVFP4Recipe(forward_override="high_precision")],
                         ids=["nvfp4", "fprop-high-precision"])
def test_layer_with_side_stream_matches_one_stream(device, monkeypatch, recipe):
    """A captured NVFP4Linear fwd+bwd gives the same bits with the weight quantized on the side
    stream as on one stream, over two replays (the SR step advances); with fprop in high
    precision, the forward's W^T is joined by dgrad, on the backward's thread."""
    torch.manual_seed(0)
    layer = NVFP4Linear(1024, 2048, recipe=recipe, device=device)
    x = torch.randn(8192, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)

    def run(model):
        out = []

        def step():
            x.grad = None
            model.weight.grad = model.bias.grad = None
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                out.append(model(x))
            out[-1].backward(dy)

        return replays(step, lambda: (out[-1], x.grad, model.weight.grad, model.bias.grad),
                       device)

    forked = run(copy.deepcopy(layer))
    monkeypatch.setattr(triton_backend, "SideStream", lambda dev: SideStream(torch.device("cpu")))
    inline = run(copy.deepcopy(layer))
    assert not torch.equal(forked[2], forked[6])  # a new SR stream on the second replay
    for a, b in zip(forked, inline):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.cuda
def test_grouped_experts_graph_replay_matches_eager(device):
    """A captured step of SwiGLU experts (backend="triton": grouped kernels) replays the eager
    step's output and gradients bit for bit, at the same SR step."""
    torch.manual_seed(0)
    experts = moe.NVFP4GroupedExperts(512, 1024, 8, recipe=NVFP4Recipe(backend="triton"),
                                      device=device)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    counts = torch.tensor([0, 700, 16, 5, 1024, 300, 1, 2048], device=device)
    x = torch.randn(int(counts.sum()), 512, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    out = []

    def step():
        x.grad = None
        for p in experts.parameters():
            p.grad = None
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            out.append(experts(x, counts))
        out[-1].backward(dy)

    def results():
        return (out[-1], x.grad, *(p.grad for p in experts.parameters()))

    graph = captured(step, device)
    buffers = [b.clone() for b in experts.buffers()]  # the SR step the replay uses
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in results()]
    for b, saved in zip(experts.buffers(), buffers):
        b.copy_(saved)
    step()
    assert not torch.equal(replayed[0], torch.zeros_like(replayed[0]))
    for a, b in zip(replayed, results()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
