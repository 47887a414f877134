"""Functions Dynamo splits into several graphs (an ``if`` on a tensor, ``.item()``): each graph is
planned with the layouts the graphs before it left their outputs in; ``simulate`` runs them in turn,
``explain`` lists them, the backend compiles them one by one (tests/test_e2e_gloo.py: on 2 ranks)."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxshard
from fxshard.backend.simulate import fake_world
from fxshard.graph import LAYOUT

MESH = fxshard.MeshSpec(tp=2)
PLAN = {"up.weight": Shard(0), "down.weight": Shard(1)}  # Megatron: column- then row-parallel
SHARDED_H = "[4] [2@tp 8]"  # the hidden activation, sharded as the column-parallel matmul leaves it


@pytest.fixture(scope="module")
def branchy():
    """rank_programs.Branchy: up, an ``if`` on the mean, ``.item()`` of the max, down (three graphs)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    try:
        from rank_programs import Branchy

        yield Branchy
    finally:
        sys.path.pop(0)


def model_and_input(branchy, sign: float = 1.0):
    torch.manual_seed(0)
    return branchy(), sign * torch.randn(4, 8)  # without a bias in ``up``, the sign picks the branch


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["relu-branch", "negate-branch"])
def test_simulate_runs_graph_after_graph_as_one_device_does(branchy, sign):
    model, x = model_and_input(branchy, sign)
    with torch.no_grad():
        expected = model(x)
        out = fxshard.simulate(model, x, mesh=MESH, placements=PLAN)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_explain_lists_each_graph_with_its_collectives(branchy):
    e = fxshard.explain(*model_and_input(branchy), mesh=MESH, placements=PLAN)
    # the scalars Python reads at the breaks leave their graphs replicated (the mean of the ``if``,
    # the max of ``.item()``); the row-parallel output stays a partial sum
    assert [[c.kind for c in g.collectives] for g in e.graphs] == [["all_reduce"], ["all_reduce"], []]
    assert [g.graph_break is not None for g in e.graphs] == [True, True, False]
    assert len(e.collectives) == 2 and e.bytes_per_rank == 8
    assert str(e).count("= input") == 6 and "over 3 graphs, communication: 2 x all_reduce(tp)" in str(e)


def test_layouts_cross_the_breaks_without_a_gather(branchy):
    e = fxshard.explain(*model_and_input(branchy), mesh=MESH, placements=PLAN)
    for before, after in zip(e.graphs, e.graphs[1:]):
        assert str(after.input_layouts["h"]) == SHARDED_H and after.input_layouts["h"] in before.output_layouts


def test_a_function_of_one_graph_is_still_one_explanation():
    e = fxshard.explain(lambda x, w: x @ w, torch.randn(4, 8), torch.randn(8, 16), mesh=MESH, placements={1: Shard(1)})
    assert isinstance(e, fxshard.backend.explain.Explanation) and e.graphs == [e]


def test_captures_never_pile_up_in_dynamos_cache(branchy):
    """After a break Dynamo compiles the model's own frames; a capture that left its entries there
    would be served to the next one, and past 8 entries Dynamo stops compiling the frame at all."""
    model, x = model_and_input(branchy)
    for _ in range(10):
        assert len(fxshard.explain(model, x, mesh=MESH, placements=PLAN).graphs) == 3


def test_parallelized_model_under_local_tensor_mode(branchy):
    """DTensor parameters holding every rank's shard: simulate and explain run the graphs on the ranks."""
    model, x = model_and_input(branchy)
    with torch.no_grad():
        expected = model(x)
    with fake_world(MESH) as mesh:
        with LocalTensorMode(2):
            parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                             "down": RowwiseParallel(use_local_output=False)})
        with torch.no_grad():
            out = fxshard.simulate(model, x)
            e = fxshard.explain(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert [str(g.input_layouts.get("h")) for g in e.graphs] == ["None", SHARDED_H, SHARDED_H]


def test_the_backend_compiles_each_graph_on_the_layouts_its_dtensors_carry(branchy):
    """Each graph Dynamo hands the backend gets the DTensors the one before returned, as they are."""
    # Dynamo reuses the resume functions it made when the other tests ran this forward on plain
    # tensors, and with DTensors they split it elsewhere (``.item()`` inside a graph)
    torch._dynamo.reset()
    model, x = model_and_input(branchy)
    inputs: list[dict[str, str]] = []

    def on_graph(stage: str, gm: torch.fx.GraphModule) -> None:
        if stage == "plan":
            inputs.append({n.name: str(n.meta[LAYOUT]) for n in gm.graph.nodes if n.op == "placeholder"})

    with fake_world(MESH) as mesh:  # rank 0 of a fake process group: the values are not checked here
        parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                         "down": RowwiseParallel(use_local_output=False)})
        with torch.no_grad():
            torch.compile(model, backend="fxshard", options={"inductor": False, "on_graph": on_graph})(x)
    assert inputs == [{"x": "[4] [8]", "up_weight": "[2@tp 8] [8]"}, {"h": SHARDED_H},
                      {"h": SHARDED_H, "down_weight": "[8] [2@tp 8]", "down_bias": "[8]"}]


def test_placements_of_an_argument_no_graph_reads_are_no_error():
    def f(x, w):
        return x @ w if x.sum() > 1e9 else x * 2  # w is read only on the branch not taken

    x = torch.ones(4, 8)
    out = fxshard.simulate(f, x, torch.randn(8, 8), mesh=MESH, placements={0: Shard(0), 1: Shard(1)})
    torch.testing.assert_close(out, x * 2)


def scatter_by_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A graph's output written in place by Python between graphs, in a loop over data-dependent rows
    (the eager MoE experts loop: ``out.index_add_`` per expert hit), then read by the next graph."""
    out = torch.zeros_like(x @ w)
    for row in torch.nonzero(x[:, 0] > 0):  # Dynamo cannot unroll it: the loop runs as Python
        out.index_add_(0, row, torch.relu(x[row] @ w))
    return out * 2 + 1


@pytest.mark.parametrize("world", [1, 2])
def test_python_writes_into_a_graph_output_between_graphs(world):
    """Each graph reads the value as Python left it, not the blocks its graph returned (a stale copy
    gave zeros here before: a silently wrong result)."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    out = fxshard.simulate(scatter_by_rows, x, w, mesh=fxshard.MeshSpec(tp=world), placements={1: Shard(1)})
    torch.testing.assert_close(out, scatter_by_rows(x, w))


@pytest.mark.slow  # ~22 s; by default the branchy model's tests (simulate and explain graph by graph) run the path
def test_eager_moe_experts_loop_runs_graph_by_graph():
    """Mixtral with transformers' eager experts (a Python loop over the experts hit): Dynamo splits it into
    many graphs; attention Megatron-sharded, everything exact, and ``explain`` reports each graph."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    try:
        from zoo import DECODER, VOCAB
    finally:
        sys.path.pop(0)
    config = transformers.MixtralConfig(attn_implementation="sdpa", experts_implementation="eager",
                                        num_local_experts=4, num_experts_per_tok=2, **{**DECODER, "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    plan = {f"model.layers.0.self_attn.{p}_proj.weight": Shard(0) for p in "qkv"}
    plan["model.layers.0.self_attn.o_proj.weight"] = Shard(1)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    with torch.no_grad():
        want = logits(ids)
        got = fxshard.simulate(logits, ids, mesh=MESH, placements=plan)
        e = fxshard.explain(logits, ids, mesh=MESH, placements=plan)
    torch.testing.assert_close(got, want)
    assert len(e.graphs) > 3 and [c.kind for c in e.collectives] == ["all_reduce"]


def test_a_program_without_calls_runs_when_its_preparation_is_read_back():
    """After a break Dynamo compiles a DTensor hook as a frame of its own (RowwiseParallel's input hook:
    a redistribute to the layout the value has), whose local program is an identity. Inductor runs such a
    program as its own Python code, and one prepared by another rank or run (read back from disk) had none:
    the rank that read it raised alone, the others ran on into a collective it never joined."""
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxshard.backend.inductor.compile_inner import compile_direct

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output((b, a))
    identity = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, y = torch.randn(4), torch.randn(3)
    with fresh_cache(), config.patch({"force_disable_caches": False, "fx_graph_cache": True}):
        for run in ("prepares and keeps it", "reads it back"):
            with FakeTensorMode() as mode:
                inputs = [mode.from_tensor(x), mode.from_tensor(y)]
            out = compile_direct(identity, inputs)(x, y)
            assert out[0] is y and out[1] is x, run


def test_training_through_breaks_on_two_gloo_ranks(tmp_path, monkeypatch):
    """A parallelized layer that branches on its output, trained under torch.compile on 2 gloo ranks with the
    on-disk caches on (a fresh directory the ranks share, as torchrun's ranks on one node do): SGD steps on
    both branches match one device, and again when a second compile reads what the first kept."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    here = pathlib.Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent / "examples"), str(here)]  # spawned ranks import these modules by name
    try:
        import rank_programs
        from ranks import spawn

        results = spawn(rank_programs.training_through_breaks, 2, timeout=600.0)
    finally:
        sys.path.remove(str(here.parent / "examples"))
        sys.path.remove(str(here))
    for rank, r in sorted(results.items()):
        for compile_, errors in zip(("first compile", "second compile"), r["errors"]):
            assert errors["loss_error"] <= 1e-5 and errors["param_error"] <= 1e-6, (rank, compile_, errors)


def test_fxshard_compile_refuses_a_function_dynamo_splits_and_says_which_door_trains_it(branchy):
    """``fxshard.compile`` captures the function as one graph: a function Dynamo splits is refused while it is
    captured (alike on every rank, before any collective), and the error names the door that takes it."""
    torch._dynamo.reset()
    model, x = model_and_input(branchy)
    with fake_world(MESH) as mesh:
        for name, placement in PLAN.items():
            owner, _, attr = name.rpartition(".")
            weight = getattr(model.get_submodule(owner), attr).detach()
            setattr(model.get_submodule(owner), attr, torch.nn.Parameter(distribute_tensor(weight, mesh, [placement])))
        with pytest.raises(RuntimeError, match=r'needs Branchy as one graph, and Dynamo breaks it \(Data-dependent '
                                               r'branching.*torch.compile\(model, backend="fxshard"\) compiles and '
                                               r'trains a function graph by graph'):
            fxshard.compile(model, inductor=False)(x)
