"""NVFP4 inside the stacks people train with: Hugging Face transformers and torch.utils.checkpoint.

(The meta-device flow is in test_linear.py, torchao's quantize_ entry point in test_api.py.)
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import nvfp4_recipe as nr

transformers = pytest.importorskip("transformers")  # in the [test] extra: runs in CI


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_hugging_face_llama_trains_generates_and_round_trips(tmp_path):
    """A tiny LlamaForCausalLM from a config: quantize_ (lm_head kept), 20 AdamW steps, generate()
    (batch 1: prompt and new-token counts that are not multiples of 16), save_pretrained, and
    from_pretrained into a plain model and into one quantized after loading."""
    recipe = nr.NVFP4Recipe(keep_bf16=("lm_head",))
    model = nr.quantize_(_tiny_llama(), recipe)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sum(isinstance(m, nr.NVFP4Linear) for m in linears) == len(linears) - 1 == 14
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 32), generator=g)
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert int(model.model.layers[0].mlp.up_proj.sr_step) == 20

    model.eval()
    prompt = ids[:1, :5]
    out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, 13) and torch.equal(out[:, :5], prompt)

    model.save_pretrained(tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    trained = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name
    requantized = nr.quantize_(transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval(), recipe)
    with torch.no_grad():
        expect = model(input_ids=ids).logits
        assert torch.equal(requantized(input_ids=ids).logits, expect)
        assert not torch.equal(plain(input_ids=ids).logits, expect)  # NVFP4 changes the output


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_gives_the_same_gradients(use_reentrant):
    """torch.utils.checkpoint recomputes the forward in backward; the backward (and so the SR
    stream, keyed by sr_step) runs once, so the gradients equal those without checkpointing."""
    torch.manual_seed(0)
    model = nr.quantize_(nn.Sequential(_Block(), _Block()))
    twin = copy.deepcopy(model)
    x0 = torch.randn(2, 16, 32)
    grads = []
    for m, wrap in ((model, False), (twin, True)):
        x = x0.clone().requires_grad_()
        for _ in range(2):  # two steps: the second uses the advanced SR streams
            m.zero_grad()
            h = x
            for block in m:
                h = (torch.utils.checkpoint.checkpoint(block, h, use_reentrant=use_reentrant)
                     if wrap else block(h))
            h.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
        assert all(int(b.fc1.sr_step) == 2 for b in m)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_hugging_face_gpt2_conv1d_trains_generates_and_round_trips(tmp_path):
    """A tiny GPT2LMHeadModel from a config: its projections are transformers' Conv1D (weight
    (in, out)); quantize_ converts all 8 (lm_head kept), a training step gives a finite loss and
    gradients close to the fp32 model's, generate() works, and save_pretrained / from_pretrained
    round trip into a plain model with the weights in their (in, out) layout."""
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=1, eos_token_id=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # same graphs
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config)
    model = nr.quantize_(copy.deepcopy(ref), nr.NVFP4Recipe(keep_bf16=("lm_head",)))
    convs = {n: m for n, m in model.named_modules() if type(m).__name__ == "NVFP4Conv1D"}
    assert len(convs) == 8 and type(model.lm_head) is nn.Linear
    assert convs["transformer.h.0.attn.c_attn"].weight.shape == (64, 192)
    assert "8 of 9 linear layers in NVFP4" in nr.summary(model)

    ids = torch.randint(3, 256, (2, 32))
    losses = []
    for m in (model, ref):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.isfinite(losses[0]) and abs(losses[0].item() - losses[1].item()) < 0.02
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p.grad).all() and p.grad.shape == q.grad.shape, name
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 0.5, name
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, ref)]
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 0.3  # 0.18-0.19 measured

    model.eval()
    prompt = ids[:1, :5]
    out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 13) and torch.equal(out[:, :5], prompt)

    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert type(plain.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    trained = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name


class _NVFP4Callback(transformers.TrainerCallback):
    """What docs/integration.md shows: QuantStats around each training step, and a BF16 forward
    (set_recipe) for the last tenth of the steps."""

    def __init__(self, model, every):
        self.stats, self.model, self.open = nr.QuantStats(model, every=every), model, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == int(0.9 * state.max_steps):
            nr.set_recipe(self.model, forward_override="high_precision")
        self.open = self.stats.step(state.global_step)
        self.open.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.open.__exit__(None, None, None)


def test_hugging_face_trainer_trains_with_statistics_and_a_late_bf16_forward(tmp_path):
    """transformers.Trainer runs an NVFP4 Llama unchanged; a callback records QuantStats and
    switches fprop to high precision for the last tenth of the steps; the SR streams advance once
    per step throughout and the model saves."""
    model = nr.quantize_(_tiny_llama(), nr.NVFP4Recipe(keep_bf16=("lm_head",)))
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 256, (40, 16), generator=g)]
    callback = _NVFP4Callback(model, every=5)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    result = trainer.train()
    assert result.global_step == 20 and torch.isfinite(torch.tensor(result.training_loss))
    assert [h["step"] for h in callback.stats.history] == [0, 5, 10, 15]
    assert set(callback.stats.history[0]["layers"]["model.layers.0.mlp.up_proj"]) == {
        "w", "x", "xt", "dy", "dyt"}
    up = model.model.layers[0].mlp.up_proj
    assert up.recipe.forward_override == "high_precision" and int(up.sr_step) == 20
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()
