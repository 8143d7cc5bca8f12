"""Tests for trainwright.model.clusters: fork/join clusters that a pipeline partition never cuts."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainwright.model.clusters import (
    INPUT,
    allowed_cuts,
    clusters_from_layer_graph,
    layer_edges,
    model_clusters,
)
from trainwright.model.graph import layers_from_export, layers_from_sequential

pytestmark = pytest.mark.timeout(60)


def _chain(n):
    return [(i, i + 1) for i in range(n - 1)]


# ----------------------------------------------------------------------------- pure core


def test_chain_gives_one_cluster_per_layer():
    assert clusters_from_layer_graph(5, _chain(5)) == [[0], [1], [2], [3], [4]]
    assert clusters_from_layer_graph(3, []) == [[0], [1], [2]]
    assert clusters_from_layer_graph(1, []) == [[0]]
    assert allowed_cuts(5, _chain(5)) == [0, 1, 2, 3]


def test_long_skip_keeps_bypassed_layers_with_their_join():
    edges = _chain(8) + [(1, 5)]
    assert clusters_from_layer_graph(8, edges) == [[0], [1], [2, 3, 4, 5], [6], [7]]
    assert allowed_cuts(8, edges) == [0, 1, 5, 6]
    # The literal rule (keep_fork=True) also keeps the fork itself in the cluster.
    assert clusters_from_layer_graph(8, edges, keep_fork=True) == [[0], [1, 2, 3, 4, 5], [6], [7]]


def test_nested_and_overlapping_skips_merge():
    nested = _chain(8) + [(1, 6), (2, 4)]
    assert clusters_from_layer_graph(8, nested) == [[0], [1], [2, 3, 4, 5, 6], [7]]
    overlapping = _chain(9) + [(1, 4), (3, 7)]
    assert clusters_from_layer_graph(9, overlapping) == [[0], [1], [2, 3, 4, 5, 6, 7], [8]]
    assert clusters_from_layer_graph(9, overlapping, keep_fork=True) == [
        [0], [1, 2, 3, 4, 5, 6, 7], [8]]


def test_join_that_is_next_fork_splits_by_default_only():
    # Residual stream: layer 2 joins the first skip and forks the second.
    edges = _chain(5) + [(0, 2), (2, 4)]
    assert clusters_from_layer_graph(5, edges) == [[0], [1, 2], [3, 4]]
    assert clusters_from_layer_graph(5, edges, keep_fork=True) == [[0, 1, 2, 3, 4]]


def test_edges_out_of_order_duplicated_and_from_input():
    edges = [(3, 7), (1, 4), (0, 1), (3, 7), (6, 7), (2, 3)]
    assert clusters_from_layer_graph(9, edges) == clusters_from_layer_graph(9, sorted(set(edges)))
    assert clusters_from_layer_graph(5, [[1, 3]]) == [[0], [1], [2, 3], [4]]  # lists accepted
    assert clusters_from_layer_graph(5, [(INPUT, 3)]) == [[0, 1, 2, 3], [4]]
    assert clusters_from_layer_graph(3, [(INPUT, 0)]) == [[0], [1], [2]]


@pytest.mark.parametrize("n_layers, edges", [
    (0, []), (-1, []), (True, []), (2.0, []),
    (5, [(3, 3)]), (5, [(4, 2)]), (5, [(0, 5)]), (5, [(-2, 1)]),
    (5, [("0", 1)]), (5, [(1, 2, 3)]), (5, [(False, 2)]), (5, [3]),
])
def test_invalid_input_raises(n_layers, edges):
    with pytest.raises(ValueError):
        clusters_from_layer_graph(n_layers, edges)
    with pytest.raises(ValueError):
        allowed_cuts(n_layers, edges)


def test_random_graphs_match_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        edges = [tuple(sorted(rng.sample(range(-1, n), 2))) for _ in range(rng.randint(0, 4))]
        edges = [e for e in edges if e[1] >= 0]
        for keep in (False, True):
            clusters = clusters_from_layer_graph(n, edges, keep_fork=keep)
            assert [i for c in clusters for i in c] == list(range(n))
            assert all(c == list(range(c[0], c[-1] + 1)) for c in clusters)
            lo = (lambda p: p) if keep else (lambda p: p + 1)
            expect = [i for i in range(n - 1)
                      if not any(c > p + 1 and lo(p) <= i < c for p, c in edges)]
            assert allowed_cuts(n, edges, keep_fork=keep) == expect
            assert [c[-1] for c in clusters[:-1]] == expect


# ------------------------------------------------------------------------- real models


def _index(layers):
    return {layer.name: k for k, layer in enumerate(layers)}


def _check_units(layers, clusters, units, between):
    """Each unit (layer names) lies in one cluster; the cuts after ``between`` are allowed."""
    index = _index(layers)
    cluster_of = {k: c for c, members in enumerate(clusters) for k in members}
    for unit in units:
        assert len({cluster_of[index[name]] for name in unit}) == 1, (unit, clusters)
    ends = {c[-1] for c in clusters[:-1]}
    for name in between:
        assert index[name] in ends, (name, clusters)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class PreNormGPT(nn.Module):
    """Blocks written out at top level: ln1/attn/ln2/mlp are siblings, adds in forward."""

    def __init__(self, n_blocks=2, d=16, heads=2, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_blocks))
        self.attn = nn.ModuleList(Attention(d, heads) for _ in range(n_blocks))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_blocks))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                               nn.Linear(4 * d, d)) for _ in range(n_blocks))
        self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        t = ids.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()  # glue: layer 0
        for ln1, attn, ln2, mlp in zip(self.ln1, self.attn, self.ln2, self.mlp, strict=True):
            h = h + attn(ln1(h), mask)
            h = h + mlp(ln2(h))
        return self.head(self.lnf(h))


def test_prenorm_transformer_keeps_residual_units_together():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    layers = layers_from_export(PreNormGPT(), (ids,), group_by="top")
    names = [layer.name for layer in layers]
    assert names == ["emb", "ln1.0", "attn.0", "ln2.0", "mlp.0", "ln1.1", "attn.1", "ln2.1",
                     "mlp.1", "lnf", "head"]
    clusters = model_clusters(layers)
    # A pre-norm block is two residual units (x + attn(ln1 x), x + mlp(ln2 x)); the cut
    # between them, like the cut between blocks, carries the residual stream alone.
    assert clusters == [[0], [1, 2], [3, 4], [5, 6], [7, 8], [9], [10]]
    units = [[f"ln1.{i}", f"attn.{i}"] for i in range(2)] + [[f"ln2.{i}", f"mlp.{i}"]
                                                             for i in range(2)]
    _check_units(layers, clusters, units, between=["emb", "mlp.0", "mlp.1"])
    # Measuring gradient flags by a run agrees with the static reading of the graph.
    assert layer_edges(layers, ids) == layer_edges(layers)
    # The causal mask (made in layer 0, read by every attention) carries no gradient; kept,
    # it makes everything from ln1.0 to the last attention one cluster.
    with_mask = model_clusters(layers, include_constants=True)
    assert with_mask == [[0], [1, 2, 3, 4, 5, 6], [7, 8], [9], [10]]
    # The literal rule (fork kept with its join) merges the whole residual stream.
    assert model_clusters(layers, keep_fork=True) == [list(range(9)), [9], [10]]


class ResNetOps(nn.Module):
    """Two basic blocks, every op a top-level submodule; identity add in forward."""

    def __init__(self, c=4, n_blocks=2):
        super().__init__()
        self.stem, self.stem_bn, self.stem_relu = nn.Conv2d(3, c, 3, padding=1), \
            nn.BatchNorm2d(c), nn.ReLU()

        def ops(make):
            return nn.ModuleList(make() for _ in range(n_blocks))

        self.conv1, self.bn1 = ops(lambda: nn.Conv2d(c, c, 3, padding=1)), ops(
            lambda: nn.BatchNorm2d(c))
        self.relu1 = ops(nn.ReLU)
        self.conv2, self.bn2 = ops(lambda: nn.Conv2d(c, c, 3, padding=1)), ops(
            lambda: nn.BatchNorm2d(c))
        self.relu_out = ops(nn.ReLU)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, 10)

    def forward(self, x):
        h = self.stem_relu(self.stem_bn(self.stem(x)))
        for i in range(len(self.conv1)):
            y = self.relu1[i](self.bn1[i](self.conv1[i](h)))
            h = self.relu_out[i](self.bn2[i](self.conv2[i](y)) + h)  # add: glue of bn2.i
        return self.fc(self.pool(h).flatten(1))


def test_resnet_blocks_never_split():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    layers = layers_from_export(ResNetOps().train(), (x,), group_by="top")
    index = _index(layers)
    assert len(layers) == 3 + 2 * 6 + 2
    clusters = model_clusters(layers)
    blocks = [[f"{op}.{i}" for op in ("conv1", "bn1", "relu1", "conv2", "bn2")]
              for i in range(2)]
    for block in blocks:  # the residual unit, fork's output to the add, is exactly a cluster
        assert [index[name] for name in block] in clusters
    _check_units(layers, clusters, blocks, between=["stem_relu", "relu_out.0", "relu_out.1"])
    assert sum(len(c) == 1 for c in clusters) == len(clusters) - 2  # the rest: one per layer


class Decoder(nn.Module):
    def __init__(self, c_in, c_skip, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in + c_skip, c_out, 3, padding=1)

    def forward(self, x, skip):
        return F.relu(self.conv(torch.cat([x, skip], dim=1)))


class TinyUNet(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU())
        self.down1 = nn.MaxPool2d(2)
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.down2 = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = Decoder(2 * c, 2 * c, c)
        self.up1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = Decoder(c, c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.down1(e1))
        m = self.mid(self.down2(e2))
        d2 = self.dec2(self.up2(m), e2)
        return self.out(self.dec1(self.up1(d2), e1))


def test_unet_long_skip_is_one_cluster():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 8)
    layers = layers_from_export(TinyUNet(), (x,), group_by="top")
    index = _index(layers)
    assert [layer.name for layer in layers] == ["enc1", "down1", "enc2", "down2", "mid", "up2",
                                                "dec2", "up1", "dec1", "out"]
    edges = layer_edges(layers)
    assert (index["enc1"], index["dec1"]) in edges and (index["enc2"], index["dec2"]) in edges
    span = list(range(index["down1"], index["dec1"] + 1))
    assert model_clusters(layers) == [[0], span, [9]]
    assert model_clusters(layers, keep_fork=True) == [[0] + span, [9]]
    assert model_clusters(layers, x) == [[0], span, [9]]


def test_sequential_layers_form_a_chain():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    layers = layers_from_sequential(seq)
    assert layer_edges(layers) == [(0, 1), (1, 2)]
    assert layer_edges(layers, torch.randn(3, 4)) == [(0, 1), (1, 2)]
    assert model_clusters(layers) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        layer_edges([])
