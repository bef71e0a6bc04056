"""The torchtitan converter (``nvfp4_recipe.torchtitan``, torchtitan 0.2): ``--model.converters
nvfp4`` with the recipe's fields as options converts torchtitan's llama3 debug model as
``quantize_`` with the same recipe would, and it trains forward and backward on the CPU."""

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("torchtitan.protocols.model_converter",
                    reason="torchtitan 0.2 is an optional extra: pip install 'nvfp4-recipe[torchtitan]'")

import nvfp4_recipe as nr  # noqa: E402
from nvfp4_recipe.linear import NVFP4Linear  # noqa: E402
from torchtitan_cases import converters as _converters, job as _job  # noqa: E402

OPTIONS = ["--nvfp4.keep_bf16", "output,layers.1.attention.*", "--nvfp4.scaling", "per_token",
           "--nvfp4.seed", "3", "--nvfp4.amax_estimation", "2", "1"]
RECIPE = nr.NVFP4Recipe(keep_bf16=("output", "layers.1.attention.*"), scaling="per_token", seed=3,
                        amax_estimation=(2.0, 1.0))


def _debug_model():
    """torchtitan's llama3 debugmodel (dim 256, 6 layers, vocab 2048) built on the meta device,
    as torchtitan's trainer builds it (before converters, then materialized and initialized)."""
    from torchtitan.models.llama3 import Transformer, llama3_args
    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=64)
    with torch.device("meta"):
        return Transformer(args)


def _materialize(model):
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():  # as torchtitan's trainer does
        model.init_weights()
    return model


def _step(model, tokens):
    """Loss (next-token cross-entropy, nats) and a backward."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def test_options_are_the_recipes_fields_with_its_defaults():
    from nvfp4_recipe.torchtitan import NVFP4
    names = [f.name for f in dataclasses.fields(NVFP4)]
    assert names == [f.name for f in dataclasses.fields(nr.NVFP4Recipe)]
    assert NVFP4().recipe() == nr.NVFP4Recipe()
    assert _job(*OPTIONS).nvfp4.recipe() == RECIPE


def test_bad_option_raises_naming_the_field():
    with pytest.raises(ValueError, match="NVFP4Recipe.seed"):
        _converters(_job("--nvfp4.seed", "-1"))


def test_converts_llama3_debug_model_as_quantize_does_and_trains():
    """The converter makes exactly the layers ``quantize_(model, RECIPE)`` makes (the same linears
    swapped, each with RECIPE and the layer seed of its name, hence the same buffers and SR
    streams); the converted model's loss is within 2% of the high-precision model's (the NVFP4
    error of 38 quantized GEMMs on a random-init model's ~ln(2048) = 7.6 nats), its gradients
    are finite and its SR step advanced."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 33), generator=g)  # 2 x 32 tokens: a multiple of 16
    model = _debug_model()
    _converters(_job(*OPTIONS)).convert(model)
    _materialize(model)
    plain = _materialize(_debug_model())
    reference = nr.quantize_(copy.deepcopy(plain), RECIPE)
    got = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {n: type(m) for n, m in got.items()} == {n: type(m) for n, m in want.items()}
    assert type(got["output"]) is torch.nn.Linear and type(got["layers.1.attention.wq"]) is torch.nn.Linear
    assert sum(type(m) is NVFP4Linear for m in got.values()) == 6 * 7 - 4
    for name, m in got.items():
        if isinstance(m, NVFP4Linear):
            assert m.recipe == RECIPE and m.layer_seed == want[name].layer_seed, name
            assert all(torch.equal(a, b) for a, b in zip(m.buffers(), want[name].buffers())), name
    loss, hp_loss = _step(model, tokens), _step(plain, tokens)
    assert abs(loss - hp_loss) < 0.02 * hp_loss
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert int(got["layers.0.feed_forward.w1"].sr_step) == 1


def test_tails_and_the_fields_recipes_through_torchtitans_options():
    """``--nvfp4.keep_last_blocks 1 --nvfp4.four_over_six activations --nvfp4.backward_override
    high_precision`` as torchtitan parses them: the last of the ``layers`` ModuleDict stays in high
    precision and the others train under the recipe."""
    model = _debug_model()
    job = _job("--nvfp4.keep_last_blocks", "1", "--nvfp4.four_over_six", "activations",
               "--nvfp4.backward_override", "high_precision")
    _converters(job).convert(model)
    _materialize(model)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(t is torch.nn.Linear for n, t in kinds.items() if n.startswith("layers.5."))
    quantized = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(quantized) == 5 * 7 + 1  # and the output projection
    assert quantized[0].recipe == nr.NVFP4Recipe(keep_last_blocks=1, four_over_six="activations",
                                                 backward_override="high_precision")
    assert "4/6-activations(mae, 256), bwd-high_precision" in repr(quantized[0])
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(_step(model, tokens))
