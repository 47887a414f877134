"""Which layer a name is of (``fxshard.layer_names``): the first indexed module in it, as graph inputs
(``_``) and module paths (``.``) spell it."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxshard.layer_names import (ROOT, block_of, common_layer, layer_index, layer_members, layer_of_inputs,
                                 renumbered, unnumbered, within_layer)

# name -> (block, layer index, name within the layer)
NAMES = [
    ("layers.0", "layers.0", 0, ""),  # torchtitan's layer itself
    ("layers.0.attention.wq.weight", "layers.0", 0, "attention.wq.weight"),  # torchtitan's parameter
    ("layers_0_attention_wq_weight", "layers_0", 0, "attention_wq_weight"),  # its graph input
    ("model.layers.12.self_attn", "model.layers.12", 12, "self_attn"),  # Hugging Face's
    ("model_layers_12_self_attn_q_proj_weight", "model_layers_12", 12, "self_attn_q_proj_weight"),
    ("layers_3_experts_7_w1", "layers_3", 3, "experts_7_w1"),  # nested lists: the first index is the layer
    ("blocks.1.0.weight", "blocks.1", 1, "0.weight"),  # a ModuleList of Sequentials
    ("saved_layers_2_norm_weight", "layers_2", 2, "norm_weight"),  # saved from a parameter: its block
    ("layers_10x_2_w", "layers_10x_2", 2, "w"),  # an index is a whole part of the name
]
NOT_LAYERS = ["tok_embeddings_weight", "model.norm.weight", "output", "w1_weight", "lm_head.weight", "x10"]


@pytest.mark.parametrize("name, block, index, within", NAMES)
def test_indexed_names(name: str, block: str, index: int, within: str) -> None:
    assert (block_of(name), layer_index(name), within_layer(name)) == (block, index, within)


@pytest.mark.parametrize("name", NOT_LAYERS)
def test_names_of_no_layer(name: str) -> None:
    assert (block_of(name), layer_index(name)) == (ROOT, None)


def test_a_saved_value_is_of_its_parameters_block() -> None:
    assert block_of("saved_layers_2_norm_weight") == block_of("layers_2_norm_weight") == "layers_2"


@pytest.mark.parametrize("name, layer, renamed", [
    ("layers_1_wq_weight", 7, "layers_7_wq_weight"),
    ("model.layers.1.mlp.up_proj.weight", 12, "model.layers.12.mlp.up_proj.weight"),
    ("layers_1_experts_1_w1", 30, "layers_30_experts_1_w1"),  # only the layer's index
])
def test_renumbered(name: str, layer: int, renamed: str) -> None:
    assert renumbered(name, layer) == renamed


@pytest.mark.parametrize("names, layer", [
    (["layers_4_wq", "layers_4_wk"], 4),
    (["layers_4_wq", "layers_5_wk"], None),  # two layers
    (["layers_4_wq", "norm_weight"], None),  # one of no layer
    ([], None),
])
def test_common_layer(names: list[str], layer: int | None) -> None:
    assert common_layer(names) == layer


def test_unnumbered_names_are_alike_in_every_layer() -> None:
    assert unnumbered("layers_3_w1_weight") == unnumbered("layers_11_w2_weight") == "layers_#_w#_weight"


def test_layer_of_inputs_reads_the_most_common_container() -> None:
    graph = fx.Graph()
    names = ["tok_embeddings_weight", "layers_0_wq", "layers_0_wk", "layers_1_wq", "layers_1_wk", "heads_0_w"]
    nodes = {name: graph.placeholder(name) for name in names}
    graph.output(tuple(nodes.values()))
    found = layer_of_inputs(fx.GraphModule(torch.nn.Module(), graph))
    assert {p.name: k for p, k in found.items()} == {"layers_0_wq": 0, "layers_0_wk": 0, "layers_1_wq": 1,
                                                    "layers_1_wk": 1}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.norm = nn.LayerNorm(2)


def test_layer_members_of_nested_lists() -> None:
    """Members of every indexed container whose class occurs there twice or more, outer first."""
    model = nn.Module()
    model.layers = nn.ModuleList(Block() for _ in range(2))
    model.head = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # no class twice: no layer
    members = layer_members(model)
    assert members == [*model.layers, *model.layers[0].experts, *model.layers[1].experts]
    paths = {id(m): path for path, m in model.named_modules()}
    assert [block_of(paths[id(m)]) for m in members] == ["layers.0", "layers.1"] + ["layers.0"] * 3 + ["layers.1"] * 3
