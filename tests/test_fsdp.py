"""FSDP2 with the NVFP4 weight all-gather (``nvfp4_recipe.fsdp``), 2 processes: the gathered
operand is the quantization of the unsharded weight bit for bit, training with it equals training
with FSDP2's high-precision gather bit for bit, fallbacks are said once and train as the
high-precision gather, and the bytes gathered. On the CPU (gloo) and, marked ``multigpu``, on two
CUDA GPUs (NCCL, Triton backend). One spawned run per device; the tests assert on what it saved.
"""

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import reference as R
from nvfp4_recipe import fsdp
from nvfp4_recipe.fsdp import FP4AllGatherWeight, all_gather_bytes, enable_fp4_all_gather
from nvfp4_recipe.kernels.runtime import interpreting
from nvfp4_recipe.spec import GemmRole

from test_distributed import DEVICES, WORLD, spawn

TOKENS = 32  # per rank
STEPS = 3
# the layer sizes of the MLP: (in, hidden, out); out_features 16 is a shard of 8 rows on 2 ranks
WIDE, NARROW = (64, 128, 64), (64, 128, 16)
GATHER_RECIPES = {"default": {}, "four_over_six": dict(four_over_six="weights")}
TRAIN_RECIPES = {"sr": {}, "per_token_rn": dict(stochastic_rounding=False, scaling="per_token")}


def _mlp(dims, recipe, device):
    """An MLP quantized under ``recipe`` on ``device``, with fresh weights equal on every rank;
    fc1's second half of rows is larger, so that rank 1's shard holds the amax."""
    torch.manual_seed(sum(dims))  # the biases
    g = torch.Generator().manual_seed(sum(dims))
    model = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.GELU(), nn.Linear(dims[1], dims[2]))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / 8)
        model[0].weight[dims[1] // 2:] *= 3
    return nr.quantize_(model.to(device), nr.NVFP4Recipe(**recipe))


def _sharded(model, mesh, fp4, compiled=False):
    """fully_shard on both linears and the root, bf16 parameters, fp32 reduction; the fp4
    all-gather enabled first when ``fp4``; each linear compiled first (aot_eager: the traced
    graph, no Inductor) when ``compiled``, as torchtitan compiles each block before sharding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if fp4:
        enable_fp4_all_gather(model)
    if compiled:
        for layer in (model[0], model[2]):
            layer.compile(backend="aot_eager")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


# the shards fsdp._quantize_shard has quantized in this process (_worker counts them)
QUANTIZED = []


def _counting(quantize_shard):
    def counted(module, shard, group):
        QUANTIZED.append(tuple(shard.shape))
        return quantize_shard(module, shard, group)
    return counted


def _train(model, rank, device, steps=STEPS):
    """AdamW steps on rank ``rank``'s tokens: per step the loss, the full gradients, the bytes
    gathered and the shards quantized; then the full weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    record = []
    for _ in range(steps):
        x, t = (torch.randn(WORLD, TOKENS, model[0].in_features, generator=g)[rank].to(device),
                torch.randn(WORLD, TOKENS, model[2].out_features, generator=g)[rank].to(device))
        QUANTIZED.clear()
        loss = (model(x).float() - t).square().mean()
        loss.backward()
        record.append({"loss": loss.detach().cpu(), "bytes": all_gather_bytes(model, reset=True),
                       "quantized": list(QUANTIZED),
                       "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
    weights = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return record, weights


class _Messages(logging.Handler):
    """Collects the package's log messages."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _gathered(dims, recipe, mesh, device):
    """(whole bf16 weights, the unsharded weights FSDP2's fp4 all-gather made) of both linears."""
    model = _mlp(dims, recipe, device)
    whole = {i: model[i].weight.detach().bfloat16().cpu() for i in (0, 2)}
    _sharded(model, mesh, fp4=True)
    got = {}
    for i in (0, 2):
        model[i].unshard()
        w = model[i].weight
        # copies: resharding frees the gathered buffers
        got[i] = {"type": type(w).__name__, "qdata": w.qdata.cpu().clone(),
                  "scale": w.scale.cpu().clone(), "outer_scale": w.outer_scale.cpu().clone(),
                  "dtype": w.dtype}
        model[i].reshard()
    return whole, got


def _worker(rank, world, device, out):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    fsdp._quantize_shard = _counting(fsdp._quantize_shard)
    messages = _Messages()
    logging.getLogger("nvfp4_recipe").addHandler(messages)
    # the Triton backend on the CPU under the interpreter only (inherited TRITON_INTERPRET=1): a
    # GPU machine checks it in the "cuda" run
    backends = (["reference"] + (["triton"] if interpreting() else [])) if device.type == "cpu" \
        else ["triton"]
    train_backend = "reference" if device.type == "cpu" else "triton"
    results = {"gathered": {}, "train": {}}
    for name, fields in GATHER_RECIPES.items():
        for backend in backends:
            results["gathered"][name, backend] = _gathered(WIDE, dict(fields, backend=backend),
                                                           mesh, device)
    cases = {**{(name, WIDE): fields for name, fields in TRAIN_RECIPES.items()},
             ("1d_weights", WIDE): dict(weight_2d=False), ("narrow", NARROW): {}}
    for (name, dims), fields in cases.items():
        recipe = dict(fields, backend=train_backend)
        results["train"][name] = {
            gather: _train(_sharded(_mlp(dims, recipe, device), mesh, gather == "fp4"), rank, device)
            for gather in ("high_precision", "fp4")}
    recipe = dict(TRAIN_RECIPES["sr"], backend=train_backend)
    results["compiled"] = _train(_sharded(_mlp(WIDE, recipe, device), mesh, True, compiled=True),
                                 rank, device)
    results["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    results["messages"] = messages.messages
    torch.save(results, out / f"fsdp_fp4_{rank}.pt")


@pytest.fixture(scope="module", params=DEVICES)
def run(request, tmp_path_factory):
    """What each rank saved, one spawned run per device."""
    out = tmp_path_factory.mktemp("fsdp_fp4")
    spawn(_worker, out, device=request.param)
    return [torch.load(out / f"fsdp_fp4_{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", list(GATHER_RECIPES))
def test_gathered_weight_is_the_quantization_of_the_unsharded_weight_bit_for_bit(run, name):
    """Each rank quantizes its 64 rows of the bf16 weight with the all-reduced amax (held by rank
    1's rows of fc1); the gathered codes, tile scales and outer scale are the reference's
    quantization of the whole bf16 weight, for every backend, with and without 4/6."""
    recipe = nr.NVFP4Recipe(**GATHER_RECIPES[name])
    for rank_results in run:
        for (recipe_name, backend), (whole, got) in rank_results["gathered"].items():
            if recipe_name != name:
                continue
            for i in (0, 2):
                want = R.quantize(whole[i], recipe.spec(GemmRole.W_FPROP))
                assert got[i]["type"] == "_GatheredWeight" and got[i]["dtype"] == torch.bfloat16
                assert torch.equal(got[i]["qdata"], want.qdata), (backend, i)
                assert torch.equal(got[i]["scale"].view(torch.uint8),
                                   want.scale.view(torch.uint8)), (backend, i)
                assert torch.equal(got[i]["outer_scale"], want.outer_scale), (backend, i)


@pytest.mark.parametrize("name", [*TRAIN_RECIPES, "1d_weights", "narrow"])
def test_fp4_all_gather_trains_as_the_high_precision_gather_bit_for_bit(run, name):
    """Three AdamW steps under FSDP2 (bf16 parameters, fp32 reduction): losses, the reduced
    gradients of every step and the final weights equal those of FSDP2's bf16 gather, bit for
    bit (fprop's W and dgrad's W^T are the same codes; wgrad's dW is the same dense GEMM); the
    fallback cases (1x16 weights, a shard of 8 rows) too."""
    for rank_results in run:
        hp, fp4 = rank_results["train"][name]["high_precision"], rank_results["train"][name]["fp4"]
        for step_hp, step_fp4 in zip(hp[0], fp4[0]):
            assert torch.equal(step_hp["loss"], step_fp4["loss"])
            for key, grad in step_hp["grads"].items():
                assert torch.equal(grad, step_fp4["grads"][key]), key
        for key, weight in hp[1].items():
            assert torch.equal(weight, fp4[1][key]), key


def test_fp4_all_gather_moves_codes_and_scales_a_quarter_of_bf16(run):
    """Per step each linear is gathered twice (forward, and backward after resharding): NVFP4
    moves N*K/2 code bytes and N*K/256 scale bytes per gather (0.2578x bf16's 2*N*K); a layer
    that falls back moves bf16."""
    for rank_results in run:
        for name in TRAIN_RECIPES:
            for step in rank_results["train"][name]["fp4"][0]:
                n_k = {"0": WIDE[0] * WIDE[1], "2": WIDE[1] * WIDE[2]}
                assert step["bytes"] == {k: 2 * (v // 2 + v // 256) for k, v in n_k.items()}
                assert sum(step["bytes"].values()) / sum(2 * 2 * v for v in n_k.values()) < 0.26
        narrow = rank_results["train"]["narrow"]["fp4"][0][0]["bytes"]
        assert narrow == {"0": 2 * (WIDE[0] * WIDE[1] // 2 + WIDE[0] * WIDE[1] // 256),
                          "2": 2 * 2 * NARROW[1] * NARROW[2]}


def test_the_backward_gather_sends_the_forwards_codes(run):
    """FSDP2 gathers each linear again for the backward; the weight has not changed since the
    forward's gather, so each rank quantizes its shard once a step (the forward's), not twice; the
    optimizer's update makes the next step quantize again. The bits are the two-quantization
    ones (test_fp4_all_gather_trains_as_the_high_precision_gather_bit_for_bit)."""
    shards = [(WIDE[1] // WORLD, WIDE[0]), (WIDE[2] // WORLD, WIDE[1])]
    for rank_results in run:
        for name in TRAIN_RECIPES:
            for step in rank_results["train"][name]["fp4"][0]:
                assert step["quantized"] == shards, name
        for step in rank_results["train"]["narrow"]["fp4"][0]:  # fc2 falls back: bf16
            assert step["quantized"] == shards[:1]


def test_fallbacks_are_said_once_naming_the_layer_and_the_reason(run):
    for rank_results in run:
        fallbacks = [m for m in rank_results["messages"] if "fp4 all-gather" in m]
        assert len(fallbacks) == 3, fallbacks
        assert sum("1x16 weight blocks" in m for m in fallbacks) == 2  # both linears, once each
        assert [m for m in fallbacks if "out_features=16 is not a multiple of 16 x 2" in m
                ][0].startswith("FSDP2 fp4 all-gather: 2 gathers its weight in high precision")


def test_enable_wraps_the_weights_and_refuses_models_without_nvfp4_layers():
    """Outside FSDP2 the wrapped weight is the same tensor: the layer computes as before."""
    model = _mlp(WIDE, {}, "cpu")
    x = torch.randn(TOKENS, WIDE[0])
    want = model(x)
    assert enable_fp4_all_gather(model) == ["0", "2"]
    assert isinstance(model[0].weight.data, FP4AllGatherWeight)
    assert torch.equal(model(x), want)
    with pytest.raises(ValueError, match="no NVFP4Linear layer"):
        enable_fp4_all_gather(nn.Sequential(nn.Linear(16, 16)))
    assert not dist.is_initialized()


def test_compiled_blocks_with_the_fp4_all_gather_train_as_eager(run):
    """Each linear compiled before fully_shard (torchtitan's order) trains with the fp4 all-gather
    exactly as in eager mode: the same losses, gradients and weights, bit for bit."""
    for rank_results in run:
        assert rank_results["graphs"] >= 1  # Dynamo compiled the layers
        (eager, eager_w), (compiled, compiled_w) = rank_results["train"]["sr"]["fp4"], rank_results["compiled"]
        for a, b in zip(eager, compiled):
            assert torch.equal(a["loss"], b["loss"]) and a["bytes"] == b["bytes"]
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
        assert all(torch.equal(eager_w[n], compiled_w[n]) for n in eager_w)
