"""What explain reports besides the graph: why each redistribution is there, totals per mesh axis,
memory per rank (concrete and as an expression of a symbolic number of ranks)."""
from __future__ import annotations

import pathlib
import sys

import pytest
import sympy
import torch
from torch.distributed.tensor import Shard

import fxshard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import Llama, LlamaConfig, megatron_placements  # noqa: E402

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=128)
megatron = megatron_placements


def test_every_redistribution_says_who_needed_what():
    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    e = fxshard.explain(f, x, w1, w2, mesh=fxshard.MeshSpec(tp=4),
                        placements={0: (Shard(0),), 1: (Shard(1),), 2: (Shard(0),)})
    assert e.collectives
    for c in e.collectives:
        producer = c.node.args[0]
        assert f"needs %{producer.name} as {c.node.meta['layout']}, it is {producer.meta['layout']}" in c.reason
        assert c.reason.startswith("%") or c.reason.startswith("the output") or "pinned" in c.reason
    assert str(e.collectives[0]) in e.report() and "memory per rank" in e.report()


def test_llama_tensor_parallel_reasons_totals_and_memory():
    model = Llama(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    e = fxshard.explain(model, x, mesh=fxshard.MeshSpec(tp=4), placements=megatron(model))
    reasons = [c.reason for c in e.collectives]
    assert len(reasons) == 2 * CFG.n_layers + 1 and all("P(sum@tp)" in r for r in reasons)  # partial sums reduced
    assert e.bytes_by_axes() == {"tp": e.bytes_per_rank}
    sharded = sum(p.numel() for n, p in model.named_parameters() if n in megatron(model))
    replicated = sum(p.numel() for n, p in model.named_parameters() if n not in megatron(model))
    assert e.memory.input_bytes == 4 * (sharded // 4 + replicated) + x.numel() * 8
    assert 0 < e.memory.peak_activations < 2 * 16 * CFG.vocab_size * 4  # less than the full logits once


def test_communication_and_memory_as_functions_of_the_number_of_ranks():
    """One trace with a symbolic tp: the bytes, the memory of inputs and the peak activations are
    expressions that agree with concrete runs at 2, 4 and 8; the head split it had to assume
    (tp divides the head counts) is listed."""
    model = Llama(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    tp = sympy.Symbol("tp", integer=True, positive=True)
    symbolic = fxshard.explain(model, x, mesh=fxshard.MeshSpec({"tp": tp}), placements=megatron(model))
    assert [c.kind for c in symbolic.collectives] == ["all_reduce"] * (2 * CFG.n_layers + 1)
    figures = {"bytes": symbolic.bytes_per_rank, "inputs": symbolic.memory.input_bytes,
               "peak": symbolic.memory.peak_activations}
    assert all(sympy.sympify(v).free_symbols == {tp} for v in figures.values()), figures
    assert f"tp divides {CFG.n_heads}" in symbolic.assumptions and "assuming" in symbolic.report()
    sharded = sum(p.numel() for n, p in model.named_parameters() if n in megatron(model))
    replicated = sum(p.numel() for n, p in model.named_parameters() if n not in megatron(model))
    assert sympy.simplify(figures["inputs"] - (4 * sharded / tp + 4 * replicated + 8 * x.numel())) == 0
    for n in (2, 4, 8):
        concrete = fxshard.explain(model, x, mesh=fxshard.MeshSpec(tp=n), placements=megatron(model))
        assert concrete.assumptions == []
        want = {"bytes": concrete.bytes_per_rank, "inputs": concrete.memory.input_bytes,
                "peak": concrete.memory.peak_activations}
        assert {k: sympy.sympify(v).subs(tp, n) for k, v in figures.items()} == want, n


@pytest.mark.parametrize("mesh, placements, axes", [
    (fxshard.MeshSpec(dp=2, tp=2), {0: (Shard(0), Shard(1)), 1: (Shard(1), Shard(0))}, {"dp", "tp"}),
])
def test_totals_per_mesh_axis(mesh, placements, axes):
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    e = fxshard.explain(lambda a, b: (a @ b).relu(), x, w, mesh=mesh, placements=placements)
    totals = e.bytes_by_axes()
    assert set(",".join(k.split(",")) for k in totals) <= axes | {"dp,tp"} and totals
    assert sum(totals.values()) == e.bytes_per_rank


def test_visualize_shows_strided_and_sub_axis_layouts():
    from expecttest import assert_expected_inline

    from fxshard import Layout, Piece

    mesh = fxshard.MeshSpec(tp=4)
    # rows: 2 outer blocks of 4 rows each cut over tp/2 (sub-axis, size 2); columns: tp%2 (size 2)
    layout = Layout(mesh, (4, 4), [[Piece(2), Piece(2, mesh.sub_axis("tp", 2, 2))],
                                   [Piece(2, mesh.sub_axis("tp", 2, 1)), Piece(2)]])
    assert_expected_inline(layout.visualize(), """\
[2 2@tp/2] [2@tp%2 2] on Mesh(tp=4); ranks in row-major order of tp
[0] 0 0 1 1
[1] 2 2 3 3
[2] 0 0 1 1
[3] 2 2 3 3""")
    from fxshard.placements import layout_from_placements

    partial = layout_from_placements(mesh, (1, 3), [torch.distributed.tensor.Partial()])
    assert "partial" in partial.visualize() and "0,1,2,3" in partial.visualize()
    with pytest.raises(ValueError, match="smaller shape"):
        Layout.replicated(mesh, (100, 100)).visualize()


def test_html_report_is_one_well_formed_page_with_graph_and_tables(tmp_path):
    from html.parser import HTMLParser

    model = Llama(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    e = fxshard.explain(model, x, mesh=fxshard.MeshSpec(tp=4), placements=megatron(model))
    text = e.to_html(tmp_path / "report.html", "Llama TP").read_text()

    class Rows(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.open = [], []

        def handle_starttag(self, tag, attrs):
            if tag not in ("meta", "br"):  # void elements have no end tag
                self.open.append(tag)
            if tag == "tr":
                self.rows.append(dict(attrs).get("class", ""))
            assert tag not in ("script", "link", "img"), tag  # self-contained, nothing to fetch

        def handle_endtag(self, tag):
            assert self.open and self.open[-1] == tag, (tag, self.open[-3:])
            self.open.pop()

    parser = Rows()
    parser.feed(text)
    assert parser.rows.count("redistribute") == len(e.collectives) == 2 * CFG.n_layers + 1
    assert len([n for n in e.graph.graph.nodes]) <= len(parser.rows)
    for heading in ("Communication", "Totals per mesh axis", "Memory per rank", "Sharded graph"):
        assert f"<h2>{heading}</h2>" in text
    assert all(html_escape(c.reason) in text for c in e.collectives)


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_golden_mlp_report(fake_mesh_4, make_mlp):
    """Megatron MLP on 4 ranks: the one all-reduce and why, the totals, the memory. Read when it changes."""
    from expecttest import assert_expected_inline
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = parallelize_module(make_mlp(), fake_mesh_4, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    e = fxshard.explain(model, torch.randn(2, 8), mesh=fake_mesh_4)
    assert_expected_inline(e.report(), """\
all_reduce(tp) 96 B/rank at %redistribute_default_1: the layout pinned at %constrain_2 (a DTensor parallel style or fxshard.constrain) needs %addmm_1 as [2] [8], it is [2] [8] P(sum@tp)
total on tp: 96 B/rank
memory per rank: inputs 368 B (5 tensors), peak activations 128 B""")


def test_hints_decide_what_a_symbolic_size_cannot():
    """tp symbolic: whether tp divides the 8 heads is unknowable; at the default hint (8) it does and
    heads stay sharded, at a hint of 32 it does not and q, k, v are gathered for attention."""
    model = Llama(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    mesh = fxshard.MeshSpec({"tp": sympy.Symbol("tp", integer=True, positive=True)})
    default = fxshard.explain(model, x, mesh=mesh, placements=megatron(model))
    large = fxshard.explain(model, x, mesh=mesh, placements=megatron(model), hints={"tp": 32})
    assert {c.kind for c in default.collectives} == {"all_reduce"} and "tp divides 8" in default.assumptions
    assert "all_gather" in {c.kind for c in large.collectives} and "tp divides 8" not in large.assumptions
    assert "tp=32" in large.report() or not large.assumptions
