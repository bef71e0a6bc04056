"""QuantStats: per layer and operand statistics of NVFP4 quantization during training, read from
the very operands the GEMMs used; they agree with tensor_stats on the same tensor, cover dense and
experts layers, record only on due steps and change no number of the training step."""

import copy
import math
import sys

import pytest
import torch
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import reference as R
from nvfp4_recipe.inspect import COUNTS, _statistics, operand_counts
from nvfp4_recipe.frozen import NVFP4FrozenLinear
from nvfp4_recipe.recipe import SR_OFFSETS
from nvfp4_recipe.spec import Block, FourOverSix, GemmRole, QuantSpec, Rounding
from nvfp4_cases import rand, signs_for
from test_moe import tiny_qwen3_moe

OPERANDS = {"w", "x", "xt", "dy", "dyt"}


def _q(x, spec, signs=None):
    return nr.NVFP4Tensor.from_operand(R.quantize(x, spec, rht_signs=signs, seed=5), x.dtype,
                                       signs, "reference")


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(Block.D2), QuantSpec(rounding=Rounding.SR),
                                  QuantSpec(rht=True)], ids=["1d", "2d", "sr", "rht"])
def test_counts_agree_with_tensor_stats(spec):
    """Flushed, saturated, zero block scales and the MSE equal tensor_stats' on the whole tensor
    (random magnitudes over 2**+-12: zero and subnormal block scales occur)."""
    x = rand((64, 128), seed=11)
    signs = signs_for(2) if spec.rht else None
    stats = _statistics(operand_counts(x, _q(x, spec, signs), max_rows=64), False)
    ref = nr.tensor_stats(x, spec, seed=5, rht_signs=signs)
    for key in ("flushed_to_zero", "saturated", "zero_scale_blocks"):
        assert stats[key] == pytest.approx(ref[key], abs=1e-12), key
    assert stats["sqnr_db"] == pytest.approx(ref["sqnr_db"], rel=1e-9)
    assert stats["relative_mse"] == pytest.approx(10 ** (-ref["sqnr_db"] / 10), rel=1e-9)
    scale = _q(x, spec, signs).scale.float()
    subnormal = ((scale > 0) & (scale < 2 ** -6)).double().mean().item()
    assert stats["subnormal_scale_blocks"] == pytest.approx(subnormal)
    assert 0 < stats["zero_scale_blocks"] < 1 and 0 < stats["flushed_to_zero"] < 1
    assert stats["subnormal_scale_blocks"] > 0 or spec.block is Block.D2  # 16x16 tiles: larger amaxes


@pytest.mark.parametrize("block", [Block.D1, Block.D2])
def test_the_sample_is_a_corner_of_the_whole_tensors_quantization(block):
    """max_rows x max_cols: whole blocks (16x16 tiles for 2d) of the whole tensor's quantization."""
    x = rand((96, 128), seed=4)
    spec = QuantSpec(block)
    head = dict(zip(COUNTS, operand_counts(x, _q(x, spec), max_rows=32, max_cols=48).tolist()))
    whole = R.dequantize(_q(x, spec).operand)[:32, :48]
    assert head["elements"] == 32 * 48
    assert head["blocks"] == (2 * 3 if block is Block.D2 else 32 * 3)
    assert head["flushed"] == ((whole == 0) & (x[:32, :48] != 0)).sum().item()
    assert head["err"] == pytest.approx((whole.double() - x[:32, :48].double()).square().sum().item())


@pytest.mark.parametrize("block", [Block.D1, Block.D2])
def test_mapped_to_4_is_the_share_of_blocks_whose_scale_4_over_6_changed(block):
    """With the 448 bound 4/6's map-to-6 candidate is the plain scale: the blocks mapped to 4 are
    exactly those whose block scale differs from the plain quantization's."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 128, generator=g)
    # tiles of integers in [-4, 4]: map-to-4 puts them on the E2M1 grid, map-to-6 (x 1.5) does not
    x[16:48, :64] = torch.randint(-4, 5, (32, 64), generator=g) * 0.25
    x = x.to(torch.bfloat16)
    plain = QuantSpec(block)
    fos = QuantSpec(block, four_over_six=FourOverSix(e4m3_max=448))
    counts = operand_counts(x, _q(x, fos), max_rows=64)
    changed = (_q(x, fos).scale.float() != _q(x, plain).scale.float()).double().mean().item()
    assert 0 < _statistics(counts, True)["mapped_to_4"] == pytest.approx(changed)
    assert "mapped_to_4" not in _statistics(counts, False)


def _step(model, x):
    out = model(x)
    (out.logits if hasattr(out, "logits") else out).float().square().mean().backward()


def test_records_due_steps_of_every_layer_and_changes_no_number():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    plain = nr.quantize_(copy.deepcopy(base), nr.NVFP4Recipe(backend="reference"))
    watched = nr.quantize_(copy.deepcopy(base), nr.NVFP4Recipe(backend="reference"))
    stats = nr.QuantStats(watched, every=2)
    for step in range(3):
        x = torch.randn(32, 64)
        _step(plain, x)
        with stats.step(step):
            _step(watched, x)
    assert [h["step"] for h in stats.history] == [0, 2]
    for entry in stats.history:
        assert set(entry["layers"]) == {"0", "2"}
        for ops in entry["layers"].values():
            assert set(ops) == OPERANDS
            for s in ops.values():
                assert 0 <= s["flushed_to_zero"] < 1 and 0 <= s["saturated"] < 1
                assert 0 < s["relative_mse"] < 0.1 and math.isfinite(s["sqnr_db"])
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert all(m.captured is None for m in watched.modules() if isinstance(m, nr.layer.NVFP4Module))


def test_experts_projections_are_layers_of_their_own():
    model = nr.quantize_(tiny_qwen3_moe(), nr.NVFP4Recipe(backend="reference", four_over_six="all"))
    stats = nr.QuantStats(model, every=1)
    with stats.step(0):
        _step(model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)))
    layers = stats.history[0]["layers"]
    experts = [name for name in layers if ".mlp.experts." in name]
    assert experts == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    for name in experts:
        assert set(layers[name]) == OPERANDS
        assert all(0 <= s["mapped_to_4"] <= 1 for s in layers[name].values())
        assert layers[name]["x"]["relative_mse"] > 0


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="every must be a positive int"):
        nr.QuantStats(nn.Linear(16, 16), every=0)
    with pytest.raises(ValueError, match="max_rows must be a positive multiple of 16"):
        nr.QuantStats(nn.Linear(16, 16), max_rows=20)
    with pytest.raises(ValueError, match="max_cols must be a positive multiple of 16"):
        nr.QuantStats(nn.Linear(16, 16), max_cols=0)
    with pytest.raises(TypeError):
        nr.QuantStats("model")


def test_graphed_refuses_experts_modules():
    model = nr.quantize_(tiny_qwen3_moe(), nr.NVFP4Recipe(backend="reference"))
    stats = nr.QuantStats(model)
    assert not stats.graphable()
    assert nr.QuantStats(nr.quantize_(nn.Sequential(nn.Linear(32, 32)), nr.NVFP4Recipe())).graphable()
    with pytest.raises(ValueError, match="experts modules"):
        stats.graphed(lambda: torch.zeros(()))


@pytest.mark.cuda
def test_graphed_recorded_steps_give_the_eager_statistics_and_losses():
    """A recorded step replayed from a CUDA graph (QuantStats.graphed) gives the statistics and
    the loss of the same step recorded eagerly, bit for bit, and trains on: two copies of a model
    take the same steps, one eagerly, one in graphs."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda()
    x = torch.randn(256, 64, device="cuda")
    runs = {}
    for mode in ("eager", "graph"):
        model = nr.quantize_(copy.deepcopy(base), nr.NVFP4Recipe(four_over_six="activations"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
        stats = nr.QuantStats(model, every=1)

        def step():
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        losses = []
        if mode == "eager":
            for i in range(5):
                with stats.step(i):
                    losses.append(step().item())
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(3):
                    with stats.step(i):
                        losses.append(step().item())
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            record = stats.graphed(step, pool=graph.pool())
            losses += [record(i).item() for i in (3, 4)]
        runs[mode] = losses, stats.history
    assert runs["graph"][0] == runs["eager"][0]
    assert runs["graph"][1] == runs["eager"][1]
    assert [h["step"] for h in runs["graph"][1]] == [0, 1, 2, 3, 4]
    assert set(runs["graph"][1][4]["layers"]["0"]) == OPERANDS


def _fresh_seed():
    return int(torch.randint(0, 2**31, ()))


def _x_counts(x):
    """operand_counts of X as fprop's A quantizes it under the default recipe (1d, per tensor, RN)."""
    return operand_counts(x, nr.NVFP4Tensor.from_hp(x, backend="reference"))


def test_gradient_accumulation_sums_the_counts_of_every_micro_batch():
    """Two micro-batches in one step: X's statistics are those of the summed counts of both (not
    the last one's), W's those of the weight alone, and the gradients are a plain model's."""
    g = torch.Generator().manual_seed(_fresh_seed())
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    plain = nr.quantize_(copy.deepcopy(base), nr.NVFP4Recipe(backend="reference"))
    watched = nr.quantize_(copy.deepcopy(base), nr.NVFP4Recipe(backend="reference"))
    x1 = torch.randn(32, 64, generator=g)
    x2 = torch.randn(48, 64, generator=g) * torch.rand(48, 64, generator=g).pow(4)  # other shares
    stats = nr.QuantStats(watched, every=1)
    with stats.step(0):
        for x in (x1, x2):
            _step(watched, x)
    for x in (x1, x2):
        _step(plain, x)
    layer = stats.history[0]["layers"]["0"]
    assert set(layer) == OPERANDS
    both = _statistics(_x_counts(x1) + _x_counts(x2), False)
    last = _statistics(_x_counts(x2), False)
    assert layer["x"] == pytest.approx(both, rel=1e-12)
    assert layer["x"]["relative_mse"] != pytest.approx(last["relative_mse"], rel=1e-3)
    w = watched[0].quantized_weight()
    assert layer["w"] == pytest.approx(_statistics(operand_counts(watched[0].weight, w), False),
                                       rel=1e-12)
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_an_eval_step_records_only_the_copies_a_no_grad_forward_makes():
    model = nr.quantize_(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)),
                         nr.NVFP4Recipe(backend="reference"))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(_fresh_seed()))
    stats = nr.QuantStats(model, every=1)
    with stats.step(0), torch.no_grad():
        model(x)
    layers = stats.history[0]["layers"]
    assert set(layers) == {"0", "2"} and all(set(ops) == {"w", "x"} for ops in layers.values())
    assert layers["0"]["x"] == pytest.approx(_statistics(_x_counts(x), False), rel=1e-12)
    with nr.capture(model) as ops, torch.inference_mode():
        model(x)
    assert set(ops["0"]) == {"w", "x"}
    with stats.step(1):  # a training step after it records every copy again
        _step(model, x)
    assert all(set(ops) == OPERANDS for ops in stats.history[1]["layers"].values())


def test_an_eval_step_of_experts_records_no_wgrad_copy():
    model = nr.quantize_(tiny_qwen3_moe(), nr.NVFP4Recipe(backend="reference"))
    stats = nr.QuantStats(model, every=1)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(_fresh_seed()))
    with stats.step(0), torch.no_grad():
        model(tokens)
    layers = stats.history[0]["layers"]
    assert "model.layers.0.mlp.experts.down_proj" in layers
    assert all(set(ops) == {"w", "x"} for ops in layers.values())


def _png_size(path):
    """(width, height) from a PNG's IHDR chunk; asserts the PNG signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plot_writes_a_png_of_the_history(tmp_path):
    pytest.importorskip("matplotlib")
    model = nr.quantize_(nn.Sequential(nn.Linear(64, 64)),
                         nr.NVFP4Recipe(backend="reference", four_over_six="weights"))
    stats = nr.QuantStats(model, every=1)
    g = torch.Generator().manual_seed(_fresh_seed())
    for step in range(3):
        with stats.step(step):
            _step(model, torch.randn(32, 64, generator=g))
    stats.plot(tmp_path / "one.png", title="tiny")
    assert _png_size(tmp_path / "one.png") == (1600, 800)
    nr.inspect.plot_quant_stats({"a": stats.history, "b": stats.history[:2]}, tmp_path / "two.png")
    assert _png_size(tmp_path / "two.png") == (1600, 800)
    with pytest.raises(ValueError, match="nothing recorded"):
        nr.QuantStats(model).plot(tmp_path / "none.png")
    with pytest.raises(TypeError, match="must be a QuantStats"):
        nr.inspect.plot_quant_stats("history", tmp_path / "bad.png")
    assert not (tmp_path / "none.png").exists() and not (tmp_path / "bad.png").exists()


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    stats = nr.QuantStats(nn.Linear(16, 16))
    stats.history.append({"step": 0, "layers": {"0": {"x": {"saturated": 0.0}}}})
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.lines"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'nvfp4-recipe\[plot\]'"):
        stats.plot(tmp_path / "q.png")
    assert not (tmp_path / "q.png").exists()


def _frozen(n, k, g, gemm="nvfp4"):
    """A frozen NVFP4 linear (n, k) from a fresh random weight's 1d quantization, reference backend."""
    w = nr.NVFP4Tensor.from_hp(torch.randn(n, k, generator=g), backend="reference")
    return NVFP4FrozenLinear(w.qdata, w.scale, w.outer_scale, recipe=nr.NVFP4Recipe(backend="reference"),
                             dtype=torch.float32, gemm=gemm)


def test_frozen_layers_record_their_activation_copies():
    """A frozen NVFP4 base records X (fprop's A) and dY (dgrad's A, SR from the layer's stream),
    with the statistics of those very quantizations; no weight (stored codes), no wgrad copy; the
    gradient is the unrecorded one; a no-grad step records X; gemm='bf16' quantizes nothing."""
    g = torch.Generator().manual_seed(_fresh_seed())
    layer = _frozen(32, 64, g)
    x = torch.randn(48, 64, generator=g)
    sr = int(layer.sr_seed) + (int(layer.sr_step) << 32)  # the key of the next backward
    y = layer(x).requires_grad_()
    y.square().mean().backward()
    dy = y.grad  # the gradient the layer receives, as autograd computes it
    xa = x.clone().requires_grad_()
    layer(xa).square().mean().backward()
    stats = nr.QuantStats(layer, every=1)
    layer.sr_step.sub_(1)  # the recorded step takes the same SR key
    xb = x.clone().requires_grad_()
    with stats.step(0):
        layer(xb).square().mean().backward()
    assert torch.equal(xa.grad, xb.grad)
    ops = stats.history[0]["layers"][""]
    assert set(ops) == {"x", "dy"}
    assert ops["x"] == pytest.approx(_statistics(_x_counts(x), False), rel=1e-12)
    dyq = nr.NVFP4Tensor.from_hp(dy, rounding="sr", seed=sr, offset=SR_OFFSETS[GemmRole.DY_DGRAD],
                                 backend="reference")
    assert ops["dy"] == pytest.approx(_statistics(operand_counts(dy, dyq), False), rel=1e-12)
    assert ops["dy"]["relative_mse"] > 0
    with stats.step(1), torch.no_grad():
        layer(x)
    assert set(stats.history[1]["layers"][""]) == {"x"}
    bf16 = nr.QuantStats(_frozen(32, 64, g, gemm="bf16"), every=1)
    with bf16.step(0):
        bf16.model(x.clone().requires_grad_()).sum().backward()
    assert bf16.history[0]["layers"] == {}
