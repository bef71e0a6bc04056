"""torchtitan's MoE models with the ``nvfp4`` converter (torchtitan 0.2): deepseek_v3,
llama4 and qwen3 (MoE flavor) built, converted, materialized and initialized as torchtitan's
trainer does (``torchtitan/train.py``: ``model_args.update_from_config(job)``, the model on the
meta device in the job's dtype, ``build_model_converters(job, dims).convert(model)``,
``model.to_empty(device)``, ``model.init_weights(buffer_device=None)`` under ``no_grad``), on one
CPU process without torch.distributed, then trained one step.

The trainer's ``init_weights`` reaches every experts module through torchtitan's
``MoE.init_weights(init_std, buffer_device)``, which calls ``self.experts.init_weights(init_std)``
(one positional float: the block's ``weight_init_std``) and reads ``self.experts.num_experts``
(the sizes of the MoE block's ``tokens_per_expert`` and ``expert_bias`` buffers).

Each debug flavor is shrunk for the CPU (2 layers of which one or two are MoE, dim 128, 4 experts
of hidden size 64 or more, vocab 256, 2 x 32 tokens); every dimension stays a multiple of 16, so
every expert and every eligible linear is converted. Its CPU limits worked around in the test:

- ``MoEArgs.use_grouped_mm = False`` (torchtitan's for-loop experts) for qwen3: deepseek_v3's
  and llama4's ``update_from_config`` turn it off themselves without an SM90 GPU, qwen3's does not,
  and its grouped path (``indices_padding_wrapper``: the Triton ``generate_permute_indices`` on
  CUDA tensors, then ``torch._grouped_mm``) cannot run on the CPU. It only changes how the
  unconverted model's experts compute; the NVFP4 experts have their own forward.
- ``torch.histc`` of integer tensors on the CPU (``NotImplementedError: "histogram_cpu" not
  implemented for 'Long'``): torchtitan's router and token reorderer count the tokens per expert
  with ``torch.histc`` of the int64 expert ids, which only CUDA implements (returning int64
  counts, which the for-loop experts need: they slice by ``counts.tolist()``). The step test
  patches ``torch.histc`` (fixture ``cpu_histc``) to count an integer CPU tensor as float32 and
  return the counts in its dtype, as CUDA does: exact for expert ids (bins of width 1 from 0 to
  the number of experts).
- The optimizer is a plain ``torch.optim.AdamW``, not the train spec's
  ``build_optimizers_with_moe_load_balancing``: its step pre-hook asks ``ParallelDims`` for the
  "loss" mesh, which builds a device mesh and needs an initialized process group. The hook only
  touches the MoE block's ``tokens_per_expert`` and ``expert_bias`` buffers, not the experts.
- The trainer's seeding (``set_determinism``) is ``torch.manual_seed(0)`` here, and the job's
  ``training.seq_len`` (32) gives the models' ``max_seq_len``.
"""

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("torchtitan.protocols.model_converter",
                    reason="torchtitan 0.2 is an optional extra: pip install 'nvfp4-recipe[torchtitan]'")

import nvfp4_recipe as nr  # noqa: E402
from nvfp4_recipe.linear import NVFP4Linear  # noqa: E402
from torchtitan_cases import converters as _converters, job as _job  # noqa: E402

SEQ_LEN = 32
VOCAB = 256
OPTIONS = ["--nvfp4.seed", "3", "--nvfp4.keep_bf16", "output"]
RECIPE = nr.NVFP4Recipe(seed=3, keep_bf16=("output",))

# model name -> (flavor, its fields replaced, its MoEArgs fields replaced); dims multiples of 16
MODELS = {
    # layer 0 dense, layer 1 MoE: 4 experts (hidden 64), top 2, 1 shared expert; MLA heads shrunk
    "deepseek_v3": ("debugmodel",
                    dict(vocab_size=VOCAB, dim=128, inter_dim=256, moe_inter_dim=64, n_layers=2,
                         n_dense_layers=1, n_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32),
                    dict(num_experts=4, num_shared_experts=1, top_k=2)),
    # layer 0 dense, layer 1 MoE (interleave step 2): 4 experts (hidden 256), top 1, 1 shared
    "llama4": ("debugmodel", dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4),
               dict(num_experts=4)),
    # both layers MoE: 4 experts (hidden 64), top 2, no shared expert
    "qwen3": ("debugmodel_moe",
              dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                   hidden_dim=256, moe_inter_dim=64),
              dict(num_experts=4, top_k=2, use_grouped_mm=False)),  # the CPU workaround above
}
NAMES = list(MODELS)


def _build(name, convert):
    """(model, model args) of torchtitan's trainer for the shrunk flavor of ``name``: the args updated
    from the job, built on the meta device in the job's dtype, converted by the job's converters
    if ``convert``, the trainer's parameter count, then materialized on the CPU and initialized
    with seed 0 (``init_weights(buffer_device=None)``, torchtitan's value without CPU offload)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools.utils import set_default_dtype
    flavor, fields, moe_fields = MODELS[name]
    job = _job("--model.name", name, "--model.flavor", flavor,
               "--training.seq_len", str(SEQ_LEN), *OPTIONS)
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])  # update_from_config mutates the args
    args = dataclasses.replace(args, **fields,
                               moe_args=dataclasses.replace(args.moe_args, **moe_fields))
    args.update_from_config(job)
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
        model = spec.model_cls(args)
    if convert:
        _converters(job).convert(model)
    args.get_nparams_and_flops(model, job.training.seq_len)  # as the trainer, after converting
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, args


def _experts(model):
    """fqn -> experts module of the model's MoE blocks (``moe.experts``)."""
    return {n: m for n, m in model.named_modules() if n.endswith("moe.experts")}


def _block_of(model, fqn):
    return model.get_submodule(fqn.rsplit(".moe.experts", 1)[0])


@pytest.fixture
def cpu_histc(monkeypatch):
    """``torch.histc`` of integer CPU tensors, as CUDA's: counted as float32 (exact for expert
    ids, integers below 2**24), returned in the input's dtype (see the module's docstring)."""
    histc = torch.histc

    def patched(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    monkeypatch.setattr(torch, "histc", patched)


def _tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=g)  # 2 x 32 tokens: a multiple of 16


def _step(model, tokens):
    """Next-token cross-entropy (nats) of the batch, a backward and one AdamW step."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    return loss.detach()


def test_the_flavors_are_moe_models_whose_experts_fit_nvfp4():
    """The shrunk flavors (unconverted) have torchtitan GroupedExperts whose dims are multiples of
    16, routers of one output per expert, and the CPU experts path; this needs no NVFP4."""
    from torchtitan.models.moe.moe import GroupedExperts
    for name in NAMES:
        model, args = _build(name, convert=False)
        experts = _experts(model)
        assert experts and all(type(m) is GroupedExperts for m in experts.values()), name
        for fqn, m in experts.items():
            assert not m.use_grouped_mm, fqn
            g, hidden, dim = m.w1.shape
            assert g == m.num_experts == args.moe_args.num_experts and hidden % 16 == 0 == dim % 16
            assert _block_of(model, fqn).moe.router.gate.out_features == g


@pytest.mark.parametrize("name", NAMES)
def test_converter_swaps_the_experts_and_init_weights_initializes_them(name):
    """(a) Every torchtitan GroupedExperts became an NVFP4GroupedExperts (the router gate stays
    nn.Linear); after torchtitan's ``init_weights`` its w1, w2, w3 are finite, nonzero, of the
    std torchtitan's init gives (w1: 0.02, w2 and w3: the block's ``weight_init_std``, 0.01 to
    0.014; truncated at +-2, 100 sigma out, so the std is the normal's, within 5% for the 32768
    or more draws of each), and every parameter of the model
    equals bit for bit the unconverted model's initialized with the same seed (the converter draws
    nothing; the experts' init draws w1, w2, w3 in torchtitan's order). (b) Its recipe buffers
    are a fresh module's (``reset_recipe_buffers``) and those ``quantize_`` gives the unconverted
    model with the same recipe (same layer seeds, same SR streams)."""
    from torchtitan.models.moe.moe import GroupedExperts
    model, _ = _build(name, convert=True)
    plain, _ = _build(name, convert=False)
    experts, plain_experts = _experts(model), _experts(plain)
    assert experts.keys() == plain_experts.keys() and experts
    assert all(type(m) is GroupedExperts for m in plain_experts.values())
    assert not any(isinstance(m, GroupedExperts) for m in model.modules())
    assert all(type(m) is nr.NVFP4GroupedExperts for m in experts.values())
    for fqn, m in experts.items():
        assert m.recipe == RECIPE and m.num_experts == plain_experts[fqn].num_experts, fqn
        assert type(_block_of(model, fqn).moe.router.gate) is torch.nn.Linear, fqn
        init_std = _block_of(model, fqn).weight_init_std
        for p, std in (("w1", 0.02), ("w2", init_std), ("w3", init_std)):
            w = getattr(m, p)
            assert w.device.type == "cpu" and torch.isfinite(w).all() and w.count_nonzero() > 0, \
                f"{fqn}.{p}"
            assert abs(w.std().item() / std - 1) < 0.05, f"{fqn}.{p}: std {w.std().item()} vs {std}"
    got, want = dict(model.named_parameters()), dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    reference = nr.quantize_(copy.deepcopy(plain), RECIPE)
    ref_experts = _experts(reference)
    for fqn, m in experts.items():
        fresh = copy.deepcopy(m)
        fresh.reset_recipe_buffers()
        for b in ("rht_signs", "sr_seed", "sr_step"):
            assert torch.equal(getattr(m, b), getattr(fresh, b)), f"{fqn}.{b}"
            assert torch.equal(getattr(m, b), getattr(ref_experts[fqn], b)), f"{fqn}.{b}"
        assert torch.equal(m.rht_signs, RECIPE.signs()) and not m.sr_step.any(), fqn
        assert m.layer_seed == ref_experts[fqn].layer_seed, fqn
    assert {n: type(x) for n, x in model.named_modules()} == \
        {n: type(x) for n, x in reference.named_modules()}


@pytest.mark.parametrize("name", NAMES)
def test_converted_moe_model_trains_one_step(name, cpu_histc):
    """(c) One step (forward on random tokens, cross-entropy, backward, AdamW) of the converted
    model and of the unconverted one from the same weights: the loss is finite and within 1% of
    the unconverted model's (measured: 2e-4 at most, over 6 batches; a random init's loss is
    ~ln(256) = 5.5 nats whatever its layers do, so this is a loose sanity check that even zeroed
    experts would pass); the gradient of each expert weight is finite and within 50% (relative L2
    error) of the unconverted model's (measured: 0.26 to 0.33, the NVFP4 error of the experts'
    three grouped GEMMs and of the quantized layers around them, a routing decision flipped by it
    included; experts giving 0 or twice their output give 1.0 or more); every other gradient and
    every weight after the step is finite and each expert projection's SR step advanced once."""
    tokens = _tokens()
    model, _ = _build(name, convert=True)
    plain, _ = _build(name, convert=False)
    loss, hp_loss = _step(model, tokens), _step(plain, tokens)
    assert torch.isfinite(loss) and torch.isfinite(hp_loss)
    assert abs(loss - hp_loss) < 0.01 * hp_loss, (loss.item(), hp_loss.item())
    for n, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n
        assert torch.isfinite(p).all(), n
    plain_experts = _experts(plain)
    for fqn, m in _experts(model).items():
        assert type(m) is nr.NVFP4GroupedExperts, fqn
        for p in ("w1", "w2", "w3"):
            grad, hp_grad = getattr(m, p).grad, getattr(plain_experts[fqn], p).grad
            assert grad is not None and torch.isfinite(grad).all(), f"{fqn}.{p}"
            error = ((grad - hp_grad).norm() / hp_grad.norm()).item()
            assert error < 0.5, f"{fqn}.{p}: gradient relative error {error:.3f}"
        assert m.sr_step.tolist() == [1, 1, 1], fqn
    assert sum(type(m) is NVFP4Linear for m in model.modules()) > 0


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_after_the_trainers_init_gives_back_the_experts_with_their_parameters(name):
    """``dequantize_`` of the converted model after torchtitan's ``to_empty`` and ``init_weights``
    gives torchtitan GroupedExperts holding the NVFP4 experts' current Parameters (the ones the
    optimizer holds, initialized), as ``dequantize_`` promises: not the meta-device Parameters the
    experts module was converted from (``to_empty`` replaces a meta Parameter with a new one)."""
    from torchtitan.models.moe.moe import GroupedExperts
    model, _ = _build(name, convert=True)
    params = {fqn: [m.w1, m.w2, m.w3] for fqn, m in _experts(model).items()}
    nr.dequantize_(model)
    for fqn, m in _experts(model).items():
        assert type(m) is GroupedExperts, fqn
        for p, want in zip(("w1", "w2", "w3"), params[fqn]):
            assert getattr(m, p) is want and not want.is_meta, f"{fqn}.{p}"
