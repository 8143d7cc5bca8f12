"""Tests for trainwright.model.graph: models cut into chain layers that match the original."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.model.graph import boundary_bytes, layers_from_export, layers_from_sequential


def _chain(layers, args):
    x = args[0] if len(args) == 1 else args
    for layer in layers:
        x = layer(x)
    return x


def _loss(out):
    return (out.float() ** 2).mean()


def _check(model, layers, args):
    """Chain output and every parameter's gradient equal the model's.

    Exported layers register the model's own parameters under the model's names; plain
    sequential layers hold them under names relative to the child, so match by identity.
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    ref = model(*args)
    _loss(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = _chain(layers, args)
    torch.testing.assert_close(out, ref)
    _loss(out).backward()
    seen = set()
    for layer in layers:
        for local_name, p in layer.named_parameters():
            assert isinstance(p, nn.Parameter)
            name = name_of[id(p)]  # shared with the model, not copied
            assert local_name == name or not hasattr(layer, "graph")
            torch.testing.assert_close(p.grad, ref_grads[name])
            seen.add(name)
    assert seen == set(ref_grads)


class TinyGPT(nn.Module):
    def __init__(self, n_blocks=3):
        super().__init__()
        cfg = GPTConfig(vocab=32, context=8, d_model=16, n_heads=2, n_blocks=n_blocks)
        layers = gpt_layers(cfg)
        self.embed, self.blocks, self.head = layers[0], nn.ModuleList(layers[1:-1]), layers[-1]

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1, self.block2 = BasicBlock(8), BasicBlock(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.block2(self.block1(F.relu(self.stem(x))))
        return self.fc(x.mean((2, 3)))  # the pooling is top-level glue: joins block2


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.dec2 = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.Upsample(scale_factor=2))
        self.dec1 = nn.Conv2d(16, 2, 3, padding=1)

    def forward(self, x):
        e1 = self.enc1(x)
        d2 = self.dec2(self.enc2(e1))
        return self.dec1(torch.cat([d2, e1], dim=1))  # long skip from enc1


def _nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.timeout(60)
def test_sequential_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    x = torch.randn(4, 6)
    layers = layers_from_sequential(model)
    assert layers == list(model)
    _check(model, layers, (x,))
    assert boundary_bytes(layers, x) == [4 * 16 * 4] * 4
    exported = layers_from_export(model, (x,))
    assert [layer.name for layer in exported] == ["0", "1", "2", "3", "4"]
    _check(model, exported, (x,))


@pytest.mark.timeout(60)
def test_empty_sequential_raises():
    with pytest.raises(ValueError, match="empty"):
        layers_from_sequential(nn.Sequential())
    with pytest.raises(ValueError, match="empty"):
        layers_from_sequential([])


@pytest.mark.timeout(60)
def test_transformer():
    torch.manual_seed(0)
    model = TinyGPT()
    ids = torch.randint(0, 32, (2, 8))
    layers = layers_from_export(model, (ids,))
    assert [layer.name for layer in layers] == ["embed", "blocks.0", "blocks.1", "blocks.2",
                                                "head"]
    _check(model, layers, (ids,))
    assert boundary_bytes(layers, ids) == [2 * 8 * 16 * 4] * 4
    clone = copy.deepcopy(layers[2])
    assert clone.name == "blocks.1"
    with torch.no_grad():
        torch.testing.assert_close(clone(layers[1](layers[0](ids))),
                                   layers[2](layers[1](layers[0](ids))))
    # an optimizer over the layers trains the model itself (parameters are shared)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    before = model.head.lm.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.head.lm.weight, before)


@pytest.mark.timeout(60)
def test_transformer_dynamic_batch():
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2)
    layers = layers_from_export(model, (torch.randint(0, 32, (2, 8)),), dynamic_batch=True)
    assert len(layers) == 4
    _check(model, layers, (torch.randint(0, 32, (5, 8)),))


@pytest.mark.timeout(60)
def test_resnet_eval():
    torch.manual_seed(0)
    model = TinyResNet().eval()
    x = torch.randn(2, 3, 8, 8)
    layers = layers_from_export(model, (x,))
    assert [layer.name for layer in layers] == ["stem", "block1", "block2", "fc"]
    _check(model, layers, (x,))
    sizes = boundary_bytes(layers, x)
    assert sizes == [2 * 8 * 8 * 8 * 4, 2 * 8 * 8 * 8 * 4, 2 * 8 * 4]


@pytest.mark.timeout(60)
def test_resnet_batchnorm_train_mode_updates_running_stats():
    torch.manual_seed(0)
    model = TinyResNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    layers = layers_from_export(model, (x,))
    assert torch.equal(model.block1.bn1.running_mean, reference.block1.bn1.running_mean)
    boundary_bytes(layers, x)  # restores buffers afterwards
    assert torch.equal(model.block1.bn1.running_mean, reference.block1.bn1.running_mean)
    torch.testing.assert_close(_chain(layers, (x,)), reference(x))
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf)
    assert not torch.equal(reference.block1.bn1.running_mean, torch.zeros(8))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch-internal, from run_decompositions
def test_functional_ir_buffer_mutations(monkeypatch):
    """Older torch exports batch-norm updates as BUFFER_MUTATION outputs: still applied."""
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export",
                        lambda *a, **k: export(*a, **k).run_decompositions({}))
    torch.manual_seed(0)
    model = TinyResNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    layers = layers_from_export(model, (x,))
    torch.testing.assert_close(_chain(layers, (x,)), reference(x))
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf)


@pytest.mark.timeout(60)
def test_unet_long_skip():
    torch.manual_seed(0)
    model = TinyUNet()
    x = torch.randn(2, 3, 8, 8)
    layers = layers_from_export(model, (x,))
    assert [layer.name for layer in layers] == ["enc1", "enc2", "dec2", "dec1"]
    _check(model, layers, (x,))
    e1 = model.enc1(x)
    e2 = model.enc2(e1)
    with torch.no_grad():
        middle = layers[1](layers[0](x))
    assert isinstance(middle, tuple) and len(middle) == 2  # (enc1 output, enc2 output)
    sizes = boundary_bytes(layers, x)
    assert len(sizes) == 3
    assert sizes[0] == _nbytes(e1)
    assert sizes[1] == _nbytes(e1) + _nbytes(e2) > _nbytes(e2)  # the skip crosses the cut
    assert sizes[2] == 2 * 16 * 8 * 8 * 4  # the concatenation (glue joins dec2)


class Nested(nn.Module):
    """Hugging Face shape: model.transformer.{wte, h[i], ln_f} and model.lm_head."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(10, 8)
        self.transformer.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.transformer.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids):
        x = self.transformer.wte(ids)
        for layer in self.transformer.h:
            x = x + torch.tanh(layer(x))
        return self.lm_head(self.transformer.ln_f(x))


@pytest.mark.timeout(60)
def test_group_by_blocks_opens_nested_models():
    torch.manual_seed(0)
    model = Nested()
    ids = torch.randint(0, 10, (2, 5))
    top = layers_from_export(model, (ids,))
    assert [layer.name for layer in top] == ["transformer", "lm_head"]
    layers = layers_from_export(model, (ids,), group_by="blocks")
    assert [layer.name for layer in layers] == ["transformer.wte", "transformer.h.0",
                                                "transformer.h.1", "transformer.ln_f", "lm_head"]
    _check(model, layers, (ids,))
    with pytest.raises(ValueError, match="group_by"):
        layers_from_export(model, (ids,), group_by="leaves")


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x, y):
        h = self.act(self.a(x))
        return self.act(self.b(h)) + y, h.sum()


@pytest.mark.timeout(60)
def test_two_inputs_two_outputs_and_shared_module():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    layers = layers_from_export(model, (x, y))
    assert [layer.name for layer in layers] == ["a", "act", "b", "act#1"]
    out = _chain(layers, (x, y))
    torch.testing.assert_close(out, model(x, y))
    with torch.no_grad():
        assert len(layers[0]((x, y))) == 2  # y rides along with a(x)
