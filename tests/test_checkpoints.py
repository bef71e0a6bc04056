"""Checkpoints of quantized models: into plain models (strict=False, or dequantize_ before saving),
and back into NVFP4 models with the SR streams where they were (docs/integration.md, Checkpoints)."""

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

import nvfp4_recipe as nr
from test_moe import tiny_qwen3_moe

BUFFERS = ("rht_signs", "sr_seed", "sr_step")
RECIPE = nr.NVFP4Recipe(backend="reference")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _trained_mlp():
    model = nr.quantize_(_mlp(), RECIPE)
    model(torch.randn(16, 32)).square().mean().backward()
    return model


def test_quantized_state_dict_into_a_plain_model_needs_strict_false():
    sd = _trained_mlp().state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key.*rht_signs"):
        _mlp(seed=1).load_state_dict(sd)
    plain = _mlp(seed=1)
    result = plain.load_state_dict(sd, strict=False)
    assert result.missing_keys == []
    assert sorted(result.unexpected_keys) == sorted(f"{i}.{b}" for i in (0, 2) for b in BUFFERS)
    for name, p in plain.named_parameters():
        assert torch.equal(p, sd[name]), name


def test_dequantize_before_saving_gives_a_plain_state_dict():
    model = _trained_mlp()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    sd = nr.dequantize_(model).state_dict()
    assert sorted(sd) == sorted(weights)
    plain = _mlp(seed=1)
    plain.load_state_dict(sd)  # strict
    for name, p in plain.named_parameters():
        assert torch.equal(p, weights[name]), name


def _moe_step(model, ids):
    """One SGD step of the causal-LM loss; returns the gradients it applied, by name."""
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return grads


def _same_step(a, b, ids):
    """Whether a step of ``a`` and of ``b`` on ``ids`` gives the same gradients and weights, bit for bit."""
    grads_a, grads_b = _moe_step(a, ids), _moe_step(b, ids)
    return (all(torch.equal(g, grads_b[name]) for name, g in grads_a.items())
            and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True)))


@pytest.fixture
def trained_moe():
    model = nr.quantize_(tiny_qwen3_moe(), RECIPE)
    _moe_step(model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert model.model.layers[0].mlp.experts.sr_step.tolist() == [1, 1]
    return model


NEXT_IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def test_moe_save_pretrained_keeps_the_experts_buffers_beside_the_per_expert_weights(trained_moe, tmp_path):
    """transformers writes the experts' weights per expert; the NVFP4 module's buffers keep their
    own keys. from_pretrained + quantize_ gives the weights, the buffers resume the SR streams."""
    trained_moe.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    experts = "model.layers.0.mlp.experts."
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved
    assert experts + "gate_up_proj" not in saved
    assert saved[experts + "sr_step"].tolist() == [1, 1]
    assert torch.equal(saved[experts + "sr_seed"], trained_moe.model.layers[0].mlp.experts.sr_seed)

    def reload():
        return nr.quantize_(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), RECIPE)
    restarted = reload()  # the weights only: the SR streams start again from step 0
    assert restarted.model.layers[0].mlp.experts.sr_step.tolist() == [0, 0]
    resumed = reload()
    buffers = {k: v for k, v in saved.items() if k.rsplit(".", 1)[-1] in BUFFERS}
    result = resumed.load_state_dict(buffers, strict=False)
    assert not set(result.missing_keys) & set(buffers) and result.unexpected_keys == []
    assert not _same_step(restarted, copy.deepcopy(trained_moe), NEXT_IDS)
    assert _same_step(resumed, trained_moe, NEXT_IDS)


def test_moe_state_dict_after_quantize_resumes_exactly(trained_moe, tmp_path):
    torch.save(trained_moe.state_dict(), tmp_path / "model.pt")
    resumed = nr.quantize_(tiny_qwen3_moe(seed=1), RECIPE)
    resumed.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict
    assert _same_step(resumed, trained_moe, NEXT_IDS)

