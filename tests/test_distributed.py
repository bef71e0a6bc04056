"""NVFP4 layers under data and tensor parallelism, 2 processes: SR streams per data-parallel rank,
DDP and FSDP2 against a single-process emulation, DCP checkpoints, tensor parallelism against the
unsharded layer. Each runs on the CPU (gloo, reference backend) and, marked ``multigpu``, on two
CUDA GPUs (NCCL, Triton backend; skipped with fewer GPUs).

Each multi-process test spawns its ranks (``torch.multiprocessing``, one GPU each on CUDA, on
127.0.0.1 through a TCPStore the test process owns, so no port can be taken in between); workers
save what they measured and the test process asserts on it.
"""

import copy
import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import reference as R
from nvfp4_recipe.distributed import data_parallel_rank, set_sr_rank
from nvfp4_recipe.formats import e2m1_decode
from nvfp4_recipe.layer import sr_key
from nvfp4_recipe.linear import NVFP4Linear
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.spec import GemmRole

from nvfp4_cases import assert_same, idfn, interpreter_only, rand, signs_for, spec

WORLD = 2
D_IN, D_HID = 64, 128
TOKENS = 32  # per rank; a multiple of 16, since wgrad blocks run along tokens
STEPS = 3
LR = 1e-2
# the CPU (gloo), and 2 GPUs (NCCL) where there are
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.multigpu])]
# NVLink multicast off in every NCCL process: on a shared host it can take the GPUs out of service
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------------
def _rank_main(rank, world, port, device_type, worker, args):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        worker(rank, world, device, *args)
        # no rank tears its group down while another still has collectives in flight (DTensor's
        # async all-reduces)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's finalization: a gloo worker thread can still be releasing the last
    # reference to a finished work (whose tensors hold Python objects) then; it cannot take the
    # GIL of a finalizing interpreter and the process aborts ("terminate called without an active
    # exception", ~1 run in 25 of the tensor-parallel worker; core dump: ~AsyncWork on gloo's
    # runLoop thread during Py_FinalizeEx). The worker's results are saved by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, *args, world=WORLD, device="cpu", timeout_s=180):
    """Run ``worker(rank, world, device, *args)`` in ``world`` processes joined by a process group:
    gloo on the CPU for ``device`` "cpu", NCCL with rank r on ``cuda:r`` for "cuda"; re-raises a
    worker's exception; kills them after ``timeout_s`` (a hung collective)."""
    if device == "cuda":
        os.environ.update(MULTICAST_OFF)  # the spawned processes inherit it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.start_processes(_rank_main, args=(world, store.port, device, worker, args),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{worker.__name__} did not finish within {timeout_s} s")


# ------------------------------------------------------------------------------------------------
# The model, the data and the single-process emulation of data parallelism
# ------------------------------------------------------------------------------------------------
def _model(device="cpu", recipe=None):
    """The MLP every test trains, quantized, on ``device``; the same weights in every process
    (seeded, drawn on the CPU) or, for the meta device, none."""
    torch.manual_seed(0)
    with torch.device("meta" if str(device) == "meta" else "cpu"):
        model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_IN))
    model = nr.quantize_(model, recipe or nr.NVFP4Recipe())
    return model if str(device) == "meta" else model.to(device)


def _batches(device="cpu"):
    """STEPS global batches (inputs, targets) of WORLD * TOKENS rows on ``device``; rank r takes
    rows [r * TOKENS, (r + 1) * TOKENS)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * TOKENS, D_IN, generator=g).to(device),
             torch.randn(WORLD * TOKENS, D_IN, generator=g).to(device)) for _ in range(STEPS)]


def _shard(t, rank):
    return t[rank * TOKENS:(rank + 1) * TOKENS]


def _loss(y, target):
    return (y.float() - target).square().mean()


def _emulate(param_dtype=None, steps=STEPS, device="cpu"):
    """Data parallelism in one process: one replica per rank (its own SR stream, sr_rank = r),
    each step every replica's gradient on its shard, their mean (fp32, as DDP's and FSDP2's
    reductions of two ranks compute it) given to every replica, an AdamW step each.
    ``param_dtype``: run forward/backward on parameters (and inputs) cast to it, as FSDP2's
    MixedPrecisionPolicy(param_dtype, reduce_dtype=float32) does.
    Returns (losses[step][rank], final state dict of replica 0), on ``device``."""
    replicas = [_model(device) for _ in range(WORLD)]
    for r, m in enumerate(replicas):
        for layer in m.modules():
            if isinstance(layer, NVFP4Linear):
                layer.sr_rank = r
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in replicas]
    losses = []
    for x, t in _batches(device)[:steps]:
        step_losses, grads = [], []
        for r, m in enumerate(replicas):
            xr = _shard(x, r)
            if param_dtype is None:
                y = m(xr)
            else:
                params = {n: p.to(param_dtype) for n, p in m.named_parameters()}
                y = torch.func.functional_call(m, params, (xr.to(param_dtype),))
            loss = _loss(y, _shard(t, r))
            loss.backward()
            step_losses.append(loss.detach())
            grads.append([p.grad for p in m.parameters()])
        mean = [sum(g) / WORLD for g in zip(*grads)]
        for m, opt in zip(replicas, opts):
            for p, g in zip(m.parameters(), mean):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad()
        losses.append(step_losses)
    return losses, replicas[0].state_dict()


def _assert_state_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].float().cpu(), want[k].float().cpu()), k


def _load(path):
    """What a worker saved, on the CPU."""
    return torch.load(path, map_location="cpu")


# ------------------------------------------------------------------------------------------------
# SR streams per data-parallel rank
# ------------------------------------------------------------------------------------------------
def test_sr_rank_is_added_to_the_key_and_rank_0_keeps_the_single_process_stream():
    """A layer with sr_rank r draws the stream of key sr_seed + r + (sr_step << 32): its gradients
    equal those of a rank-0 layer whose sr_seed is larger by r; rank 0 is a plain layer."""
    torch.manual_seed(0)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    layer = NVFP4Linear(64, 32, layer_seed=7)

    def grads(m):
        xi = x.clone().requires_grad_()
        m(xi).backward(dy)
        return xi.grad, m.weight.grad

    base = grads(copy.deepcopy(layer))
    ranked, shifted = copy.deepcopy(layer), copy.deepcopy(layer)
    ranked.sr_rank = 3
    with torch.no_grad():
        shifted.sr_seed += 3
    got, want = grads(ranked), grads(shifted)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not any(torch.equal(a, b) for a, b in zip(got, base))
    assert int(sr_key(layer.sr_seed, torch.tensor(5), 0)) == int(layer.sr_seed) + (5 << 32)


def test_set_sr_rank_without_a_process_group_is_rank_0_and_needs_nvfp4_layers():
    model = _model()
    assert not dist.is_initialized() and data_parallel_rank() == 0
    assert set_sr_rank(model) == 0 and all(m.sr_rank == 0 for m in (model[0], model[2]))
    assert "sr_rank" not in str(model.state_dict().keys())
    with pytest.raises(ValueError, match="no NVFP4 layer"):
        set_sr_rank(nn.Sequential(nn.Linear(16, 16)))


def test_averaged_wgrad_sr_noise_falls_as_one_over_the_number_of_ranks():
    """The SR noise of dW = Q_SR(dY^T) Q(X^T)^T averaged over R ranks (emulated: the same layer,
    input and dY, sr_rank = 0..R-1) has mean square E = tr(C) / R around the exact expectation.

    The expectation is exact: an element's 8 random bits are uniform, so E[q] and Var[q] of each
    dY^T code are the mean and variance over its 256 possible roundings (``reference.round_sr``);
    E[dW] = E[dY^T] X_q^T, and the noise of row n of dW has covariance
    C_n = X_q diag(Var[dY^T_n]) X_q^T (independent bits per element), C = blockdiag(C_n).
    Each entry of dW is a sum of 256 independent bounded terms, so the noise is close to
    Gaussian and the measured mean square of one realization has standard deviation
    sqrt(2 tr(C^2)) / R (here about 2% of the mean); the test allows 6 of them. With one stream
    shared by all ranks (every sr_rank 0, as before ranks were folded into the key) the mean would
    be the single rank's dW, whose noise does not fall at all: R = 2 would measure twice the bound."""
    torch.manual_seed(0)
    m_tok, k, n = 256, 64, 64
    layer = NVFP4Linear(k, n, bias=False, layer_seed=11)
    x, dy = torch.randn(m_tok, k), torch.randn(m_tok, n)
    signs, recipe = layer.rht_signs, layer.recipe

    def wgrad(rank):
        layer.weight.grad, layer.sr_rank = None, rank
        with torch.no_grad():
            layer.sr_step.zero_()
        layer(x).backward(dy)
        return layer.weight.grad.double()

    spec = recipe.spec(GemmRole.DY_WGRAD)
    t = R.rht(dy.t().contiguous(), signs)  # fp32 input: the RHT output is fp32
    s_enc = R.encode_scale(R.amax(t, spec.scaling))
    blocks = t.reshape(n, m_tok // 16, 16)
    sf = R.block_scales(blocks, s_enc)
    v = torch.clamp(blocks * R.value_scales(sf, R.decode_scale(s_enc))[..., None], -6, 6)
    decoded = torch.stack([e2m1_decode(R.round_sr(v, torch.full(v.shape, b)))
                           for b in range(256)]).double()
    scale = sf.double()[..., None] * R.decode_scale(s_enc).double()
    mean = (decoded.mean(0) * scale).reshape(n, m_tok)
    var = (decoded.var(0, unbiased=False) * scale ** 2).reshape(n, m_tok)
    xq = R.dequantize(R.quantize(x.t().contiguous(), recipe.spec(GemmRole.X_WGRAD),
                                 rht_signs=signs)).double()  # (k, m)
    exact = mean @ xq.t()
    trace = (var @ (xq ** 2).t()).sum()
    cov = torch.einsum("km,nm,jm->nkj", xq, var, xq)
    spread = (2 * cov.square().sum()).sqrt() / trace

    dws = [wgrad(r) for r in range(4)]
    for ranks in (1, 2, 4):
        mse = (sum(dws[:ranks]) / ranks - exact).square().sum()
        assert abs(mse * ranks / trace - 1) < 6 * spread, (ranks, mse * ranks / trace, spread)
    assert spread < 0.05


# ------------------------------------------------------------------------------------------------
# The amax hook of the backends
# ------------------------------------------------------------------------------------------------
def _halves_reducer(whole_amax, calls):
    """An amax reducer emulating an all-reduce (max) with the other half of a tensor."""
    def reduce(a):
        calls.append(a.clone())
        return torch.maximum(a, whole_amax)
    return reduce


@pytest.mark.parametrize("backend, where", [
    ("reference", "cpu"),
    pytest.param("triton", "cpu",
                 marks=interpreter_only("its [triton-cuda] parametrization runs on the GPU")),
    pytest.param("triton", "cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("sp", [spec(), spec(rht=True), spec(scaling="per_token", rht=True),
                                spec(rht=True, amax_scale=2.0)], ids=idfn)
def test_amax_reduce_quantizes_a_row_shard_as_the_whole_tensor(backend, where, sp):
    """The top half of x (rows cut, as a tensor-parallel shard), quantized with a reducer that
    returns the whole tensor's amax, is the top half of x's quantization: the rowwise copy its
    rows, the columnwise copy (blocks along the rows) its first block columns, the 2d weight its
    first tile rows and W^T's first tile columns; the reducer sees the shard's own measured amax
    (before amax estimation's factor, which applies to the reduced amax). (RN: a
    column shard's SR counters differ from the whole's, see ``distributed.py``.)"""
    be = get_backend(backend, torch.device(where))
    x, signs, half = rand((64, 64), device=where), signs_for().to(where), 32
    top = x[:half]
    row = spec()  # the rowwise copy of a pair never takes the RHT
    calls = []
    kw = dict(seed=5, row_offset=0, col_offset=0, signs=signs)
    whole_r, whole_c, _ = be.quantize_pair(x, row, sp, **kw)
    amax_r, amax_c = R.operand_amax(x, row), R.operand_amax(x.t(), sp, signs)
    reduce = (_halves_reducer(amax_r, calls), _halves_reducer(amax_c, calls))
    got_r, got_c, _ = be.quantize_pair(top, row, sp, **kw, amax_reduce=reduce)
    assert_same(got_r, R.NVFP4Operand(whole_r.qdata[:half], whole_r.scale[:half],
                                      whole_r.outer_scale))
    assert_same(got_c, R.NVFP4Operand(whole_c.qdata[:, :half // 2], whole_c.scale[:, :half // 16],
                                      whole_c.outer_scale))
    assert torch.equal(calls[0], R.operand_amax(top, row))
    assert torch.equal(calls[1], R.operand_amax(top.t(), sp, signs))
    got = be.quantize(top.t(), sp, seed=5, signs=signs, amax_reduce=reduce[1])
    assert_same(got, got_c)
    w, wt = be.prepare_weight(x, spec(block="2d"), need_t=True)
    got_w, got_wt = be.prepare_weight(top, spec(block="2d"), need_t=True,
                                      amax_reduce=_halves_reducer(amax_r, calls))
    assert torch.equal(R.dequantize(got_w), R.dequantize(w)[:half])  # codes or inner values
    assert_same(got_wt, wt._replace(qdata=wt.qdata[:, :half // 2], scale=wt.scale[:, :half // 16]))


# ------------------------------------------------------------------------------------------------
# DDP
# ------------------------------------------------------------------------------------------------
def _ddp_worker(rank, world, device, out):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model(device)
    assert set_sr_rank(model) == rank
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, t in _batches(device):
            loss = _loss(ddp(_shard(x, rank)), _shard(t, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    torch.save({"losses": losses, "state": model.state_dict(),
                "warnings": [str(w.message) for w in caught]}, out / f"ddp{rank}.pt")


@pytest.mark.parametrize("device", DEVICES)
def test_ddp_matches_single_process_emulation_bit_for_bit(tmp_path, device):
    spawn(_ddp_worker, tmp_path, device=device)
    losses, state = _emulate(device=device)
    for rank in range(WORLD):
        got = _load(tmp_path / f"ddp{rank}.pt")
        assert got["warnings"] == []
        assert [float(loss) for loss in got["losses"]] == [float(s[rank]) for s in losses]
        _assert_state_equal(got["state"], state)


# ------------------------------------------------------------------------------------------------
# FSDP2 (meta-device init, bf16 parameters, fp32 reduction) and DCP
# ------------------------------------------------------------------------------------------------
def _fsdp_model(full_state, device):
    """The MLP built on the meta device, quantized, sharded with fully_shard (bf16 parameters,
    fp32 gradient reduction), materialized on ``device``, loaded from ``full_state``; also the
    buffers it had right after ``to_empty``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = _model(device="meta")
    set_sr_rank(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    fresh = {k: v.clone() for k, v in model.named_buffers()}
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True))
    return model, fresh


def _fsdp_steps(model, opt, rank, batches):
    losses = []
    for x, t in batches:
        loss = _loss(model(_shard(x, rank)), _shard(t, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _fsdp_worker(rank, world, device, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    full = StateDictOptions(full_state_dict=True)
    init = _model(device).state_dict()
    model, fresh = _fsdp_model(init, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _fsdp_steps(model, opt, rank, batches[:-1])
    trained = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out / "ckpt")
    # a new meta-initialized FSDP2 model loads the sharded checkpoint; both then take one more step
    other, _ = _fsdp_model(init, device)
    state = {"model": get_model_state_dict(other)}
    dcp.load(state, checkpoint_id=out / "ckpt")
    set_model_state_dict(other, state["model"])
    reloaded = {k: v.clone() for k, v in get_model_state_dict(other, options=full).items()}
    last = [_fsdp_steps(m, torch.optim.SGD(m.parameters(), lr=LR), rank, batches[-1:])[0]
            for m in (model, other)]
    torch.save({"losses": losses, "fresh": fresh, "trained": trained, "reloaded": reloaded,
                "last": last, "warnings": [str(w.message) for w in caught]},
               out / f"fsdp{rank}.pt")


@pytest.fixture(scope="module", params=DEVICES)
def fsdp_run(request, tmp_path_factory):
    """(checkpoint folder, what each rank saved, device) of one FSDP2 run."""
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_fsdp_worker, out, device=request.param)
    return out, [_load(out / f"fsdp{r}.pt") for r in range(WORLD)], request.param


def test_fsdp2_meta_init_matches_single_process_emulation_bit_for_bit(fsdp_run):
    """fully_shard on a model quantized on the meta device, bf16 parameters and fp32 gradient
    reduction: losses and the trained fp32 master weights equal the emulation's (forward and
    backward on bf16 casts of the parameters, gradients cast to fp32 and averaged)."""
    _, runs, device = fsdp_run
    losses, state = _emulate(param_dtype=torch.bfloat16, steps=STEPS - 1, device=device)
    meta_built = _model()
    for rank, got in enumerate(runs):
        # to_empty gave the recipe buffers a new layer's values, not uninitialized memory
        for name, buf in meta_built.named_buffers():
            assert torch.equal(got["fresh"][name], buf), name
        assert [float(loss) for loss in got["losses"]] == [float(s[rank]) for s in losses]
        _assert_state_equal(got["trained"], state)


def test_fsdp2_training_raises_no_warning(fsdp_run):
    """In particular not FSDP2's 'returned a view tensor': the layer's output is not a view."""
    _, runs, _ = fsdp_run
    assert [w for run in runs for w in run["warnings"]] == []


def test_dcp_round_trip_of_a_sharded_quantized_model(fsdp_run):
    """A new meta-initialized FSDP2 model loading the DCP checkpoint holds the same weights and
    recipe buffers (sr_step included) and takes the same next step, bit for bit."""
    _, runs, _ = fsdp_run
    for got in runs:
        _assert_state_equal(got["reloaded"], got["trained"])
        assert int(got["reloaded"]["0.sr_step"]) == STEPS - 1
        assert torch.equal(got["last"][0], got["last"][1])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's single-process notice
def test_dcp_checkpoint_loads_into_a_plain_bf16_model(fsdp_run):
    """The sharded checkpoint of the quantized model loads, in one process, into a plain
    nn.Sequential in bf16: its weights are the bf16 roundings of the trained fp32 masters (the
    recipe buffers in the checkpoint are simply not asked for)."""
    import torch.distributed.checkpoint as dcp
    out, runs, _ = fsdp_run
    plain = nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_IN)).bfloat16()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=out / "ckpt", no_dist=True)
    plain.load_state_dict(state["model"])
    for name, p in plain.state_dict().items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, runs[0]["trained"][name].to(torch.bfloat16)), name


# ------------------------------------------------------------------------------------------------
# Tensor parallelism
# ------------------------------------------------------------------------------------------------
TP_RECIPES = {"rn": dict(stochastic_rounding=False),
              "per_token_rn": dict(stochastic_rounding=False, scaling="per_token"),
              "sr": {}}


def _tp_worker(rank, world, device, out):
    """fc1 ColwiseParallel, fc2 RowwiseParallel, against the unsharded model on the same input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(device.type, (world,))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    results = {}
    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(2, TOKENS, D_IN, generator=g).to(device) for _ in range(2))
    for name, fields in TP_RECIPES.items():
        ref = _model(device, recipe=nr.NVFP4Recipe(**fields))
        tp = parallelize_module(copy.deepcopy(ref), mesh, plan)
        res = {}
        for key, model in (("ref", ref), ("tp", tp)):
            xi = x.clone().requires_grad_()
            h = model[0](xi)
            h.retain_grad()
            y = model[2](model[1](h))
            y.backward(dy)
            grads = {f"{i}.{p}": getattr(model[i], p).grad for i in (0, 2) for p in ("weight", "bias")}
            res[key] = {"y": y.detach().clone(), "dx": xi.grad, "dh": h.grad,
                        **{k: v.full_tensor() if key == "tp" else v for k, v in grads.items()}}
        if name == "sr":
            res["key"] = sr_key(ref[0].sr_seed, torch.tensor(0, device=device))
            res["w1"] = ref[0].weight.detach()
        results[name] = res
    errors = {}
    narrow = parallelize_module(NVFP4Linear(D_IN, 48).to(device), mesh, ColwiseParallel())
    for case, call in (("narrow", lambda: narrow(x)),
                       ("plain_input", lambda: tp[0].forward(x))):
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[case] = f"{type(e).__name__}: {e}"
    if rank == 0:
        torch.save({"results": results, "errors": errors}, out / "tp.pt")


@pytest.fixture(scope="module", params=DEVICES)
def tp_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    spawn(_tp_worker, out, device=request.param)
    return {**_load(out / "tp.pt"), "device": request.param}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(TP_RECIPES))
def test_tensor_parallel_weight_gradients_equal_the_unsharded_layers_bit_for_bit(tp_run, name):
    """Every rank quantizes its shards with the whole tensor's amax (per tensor, and per row where
    rows are cut), and a shard's SR counters start where its rows start: dW and db, computed
    without partial sums, are the unsharded layer's bits for RN and SR recipes, and so is the
    gradient reaching fc1's output (rank 0's shard of it, through the rowwise layer's dgrad).
    On CUDA the column-parallel db is not: see the next test."""
    res = tp_run["results"][name]
    keys = ("0.weight", "0.bias", "2.weight", "2.bias")
    for key in keys if tp_run["device"] == "cpu" else keys[:1] + keys[2:]:
        assert torch.equal(res["tp"][key], res["ref"][key]), key
    assert torch.equal(res["tp"]["dh"], res["ref"]["dh"][..., :D_HID // WORLD])


@pytest.mark.parametrize("name", list(TP_RECIPES))
def test_tensor_parallel_colwise_bias_gradient_is_the_unsharded_one_to_fp32_summation_order(
        tp_run, name):
    """The column-parallel db is ``dY.sum(0, dtype=float32)`` of the rank's (M, N/2) columns of
    the same dY bits (the test above: dh). Each column is a sum of the same M values, but CUDA's
    reduction kernel picks its block shape and how many threads (and blocks) share a column from
    the tensor's shape, N included (``setReduceConfig`` in ATen's Reduce.cuh): N/2 columns sum in
    another order than N, so the fp32 sums may differ in their last bits (the CPU's kernel adds
    the rows in order either way: equal bits, above). Bound of two orders of M terms:
    ``|db_tp - db| <= 2 gamma_(M-1) sum_i |dY_ij|``, gamma_n = n u / (1 - n u), u = 2^-24."""
    res = tp_run["results"][name]
    dy = res["ref"]["dh"].reshape(-1, D_HID).double()
    n = dy.shape[0] - 1
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    err = (res["tp"]["0.bias"].double() - res["ref"]["0.bias"].double()).abs()
    assert (err <= 2 * gamma * dy.abs().sum(0)).all()


@pytest.mark.parametrize("name", list(TP_RECIPES))
def test_tensor_parallel_partial_sums_equal_the_unsharded_layer_to_fp32_accumulation(tp_run, name):
    """Y (rowwise: partial sums over the ranks' K shards) and, for RN, dX (colwise: partial sums
    over the N shards) add the same products in another order in fp32: relative error at the
    fp32 level (2^-24 per addition over <= 128 terms), far below NVFP4's."""
    res = tp_run["results"][name]
    assert _rel(res["tp"]["y"], res["ref"]["y"]) < 1e-6
    if name != "sr":
        assert _rel(res["tp"]["dx"], res["ref"]["dx"]) < 1e-6


def test_tensor_parallel_colwise_dgrad_sr_draws_its_bits_in_shard_major_order(tp_run):
    """Colwise dgrad quantizes dY's column shards: rank r's (M, N/2) shard takes the SR counters
    after rank r-1's (r * M * N/2 / 16), the unsharded stream in another order. dX equals that
    emulation (reference quantization of each shard with the whole dY's amax) up to fp32
    accumulation order, and differs from the unsharded layer's draw."""
    res = tp_run["results"]["sr"]
    recipe = nr.NVFP4Recipe()
    dh = res["ref"]["dh"].reshape(-1, D_HID)
    spec = recipe.spec(GemmRole.DY_DGRAD)
    amax = R.amax(dh, spec.scaling)
    w = R.dequantize(R.quantize(res["w1"], recipe.spec(GemmRole.W_FPROP))).double()
    half = D_HID // WORLD
    dx = sum(R.dequantize(R.quantize(dh[:, r * half:(r + 1) * half].contiguous(), spec,
                                     seed=res["key"], offset=r * dh.shape[0] * half // 16,
                                     amax_=amax)).double() @ w[r * half:(r + 1) * half]
             for r in range(WORLD))
    assert _rel(res["tp"]["dx"].reshape(-1, D_IN), dx) < 1e-6
    assert _rel(res["ref"]["dx"].reshape(-1, D_IN), dx) > 1e-3


def test_tensor_parallel_refuses_shards_of_partial_blocks_and_plain_inputs(tp_run):
    errors = tp_run["errors"]
    assert errors["narrow"].startswith("ValueError") and "multiple of 16 x 2 ranks" in errors["narrow"]
    assert errors["plain_input"].startswith("TypeError") and "DTensor input" in errors["plain_input"]


def _fsdp_tp_worker(rank, world, device, out):
    """2 x 2 mesh: fully_shard over "dp", fc1 ColwiseParallel and fc2 RowwiseParallel over "tp";
    SR ranks from the "dp" dimension; one backward of dp rank r's shard of a global batch with a
    given output gradient (a loss of the output would differ from the unsharded one's by the
    rounding of the rowwise partial sums)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    set_sr_rank(model, mesh["dp"])
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    x, dy = _batches()[0]
    dp = mesh["dp"].get_local_rank()
    model(_shard(x, dp)).backward(_shard(dy, dp))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out / "fsdp_tp.pt")


def test_fsdp2_over_tensor_parallel_2d_mesh_matches_data_parallel_emulation(tmp_path):
    """FSDP2 on the data-parallel dimension of a 2 x 2 mesh over tensor-parallel layers, SR ranks
    from that dimension (tensor-parallel ranks share streams): the averaged weight and bias
    gradients are the single-process emulation's (one unsharded replica per data-parallel rank),
    bit for bit: tensor parallelism computes them without partial sums (see above)."""
    spawn(_fsdp_tp_worker, tmp_path, world=4)
    got = _load(tmp_path / "fsdp_tp.pt")
    replicas = [_model() for _ in range(WORLD)]
    x, dy = _batches()[0]
    for r, m in enumerate(replicas):
        for layer in (m[0], m[2]):
            layer.sr_rank = r
        m(_shard(x, r)).backward(_shard(dy, r))
    for name, p in replicas[0].named_parameters():
        q = dict(replicas[1].named_parameters())[name]
        assert torch.equal(got[name], (p.grad + q.grad) / WORLD), name
