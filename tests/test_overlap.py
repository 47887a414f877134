"""Collectives bucketed and waits overlapped by Inductor's own passes (backend/inductor/compile_local.py).

FSDP in miniature (``rank_programs.Blocks``: two residual MLP blocks, every weight Shard(0) on 4
ranks): fxshard lowers one all_gather per weight and one reduce_scatter per gradient, each wait
right behind its collective; Inductor merges each block's into one and moves waits below compute.
Counts are read from the code Inductor generates, on a fake process group (rank 0), for whole
programs (``regional: False``: regional compilation, backend/layers/regions.py, compiles each block apart,
and Inductor buckets and overlaps inside each), read from Inductor's Python wrapper
(``FXSHARD_CPU_WRAPPER=0``): fxshard's CPU programs run in its C++ wrapper, whose calls are the same
calls in the same order (tests/test_cpu_wrapper.py).
"""
from __future__ import annotations

import math
import pathlib
import re
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend.inductor.buckets import BLOCK_KEY, block_buckets, nodes_made, tag_blocks
from fxshard.backend.inductor.compile_local import BucketPolicy, block_bytes, inductor_patches
from fxshard.backend.simulate import fake_world, lowered_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import Blocks, MLPBlock, SwiGLUBlock, sequence_parallel, shard_parameters  # noqa: E402

COST = fxshard.CostModel(default_latency=0.0)  # bytes decide: weights are gathered, not activations
DIM, HIDDEN, TOKENS = 32, 64, 256

_COLLECTIVE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)\w*\.default\(")
# a call's first argument: a buffer, or a view of one (an in-place all_reduce of a reshaped matmul output)
_ARGUMENT = re.compile(r"\.default\((?:reinterpret_tensor\()?(\w+)[,)]")
_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def statements(code: str) -> list[str]:
    """The statements of Inductor's ``call``: no comments, shape asserts or dels."""
    body = code[code.index("def call(self, args):"):]
    body = body[:body.index("\n        return ")]
    return [s for line in body.splitlines()[1:]
            if (s := line.strip()) and not s.startswith(("#", "assert_", "del "))]


def collectives(lines: list[str]) -> list[tuple[str, int]]:
    """(kind, statements of compute between its start and its wait) for each collective, in order.

    Compute: an extern kernel (the matmuls; fused C++ kernels also copy into and out of buckets). The wait is the ``wait_tensor`` of the
    collective's buffer (its result, its ``out=``, or the in-place all_reduce's argument), or the program's end."""
    found = []
    for i, line in enumerate(lines):
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        buffer = (re.search(r"out=(\w+)\)", line) or re.match(r"(\w+) = ", line)
                  or re.search(_ARGUMENT, line)).group(1)
        wait = next((j for j in range(i + 1, len(lines))
                     if "wait_tensor.default(" in lines[j] and re.search(_ARGUMENT, lines[j]).group(1) == buffer),
                    len(lines))  # none: the program returns the buffer, and a later program waits
        compute = sum(1 for s in lines[i + 1:wait] if s.startswith("extern_kernels."))
        found.append((_KIND[match.group(1)], compute))
    return found


def lowered_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """The same for fxshard's lowered program (stage 5): FX nodes, compute being any other op."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    found = []
    for i, node in enumerate(nodes):
        name = node.target.__name__.split(".")[0]
        if name in _KIND:
            wait = next(j for j in range(i + 1, len(nodes)) if nodes[j].args and nodes[j].args[0] is node)
            found.append((_KIND[name], wait - i - 1))
    return found


@pytest.fixture(scope="module", autouse=True)
def python_wrapper():
    """Inductor's code as Python (the module docstring)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FXSHARD_CPU_WRAPPER", "0")
        yield


@pytest.fixture(scope="module")
def training_step(fake_mesh_4):
    """{program: (fxshard's lowered collectives, Inductor's, Inductor's statements)} of one compiled training step."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN)
    shard_parameters(model, fake_mesh_4)
    lowered: dict = {}  # read when reported: Inductor may rewrite the graph it compiles
    options = {"cost_model": COST, "regional": False,
               "on_graph": lambda stage, gm: lowered.setdefault(stage, lowered_collectives(gm))
               if stage.startswith("lower") else None}
    compiled = torch.compile(model, backend="fxshard", options=options)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])

    def step() -> torch.Tensor:
        loss = compiled(x)
        loss.backward()
        return loss
    _, (forward, backward) = run_and_get_code(step)
    forward, backward = statements(forward), statements(backward)
    return {"forward": (lowered["lower"], collectives(forward), forward),
            "backward": (lowered["lower_backward"], collectives(backward), backward)}


def counts(found: list[tuple[str, int]]) -> dict[str, int]:
    result: dict[str, int] = {}
    for kind, _ in found:
        result[kind] = result.get(kind, 0) + 1
    return result


@pytest.mark.parametrize("program, lowered, compiled", [
    # one all_gather per weight (4), the loss summed; Inductor: one bucket per block
    ("forward", {"all_gather": 4, "all_reduce": 1}, {"all_gather": 2, "all_reduce": 1}),
    # the weights the input gradients need, regathered (the last block's too: only a root parameter is
    # kept gathered from the forward, joint.reuse_first_gather); one reduce_scatter per gradient;
    # Inductor: one bucket per block and kind
    ("backward", {"all_gather": 3, "reduce_scatter": 4}, {"all_gather": 2, "reduce_scatter": 2}),
])
def test_each_block_is_one_bucket(training_step, program, lowered, compiled):
    fxshard_lowered, inductor, _ = training_step[program]
    assert (counts(fxshard_lowered), counts(inductor)) == (lowered, compiled)


@pytest.mark.parametrize("program, overlapped", [
    ("forward", ["all_gather"]),       # the second block's weights arrive while the first block computes
    # each block's regathered weights arrive while the gradients before them compute (the gather reads
    # the parameter itself: nothing delays its start), and the last block's gradients are reduced while
    # the first block's compute
    ("backward", ["all_gather", "all_gather", "reduce_scatter"]),
])
def test_waits_move_below_compute(training_step, program, overlapped):
    """fxshard lowers every wait right behind its collective; Inductor's scheduler moves it below the
    compute that does not need the result (the first gather and the last reductions have none left)."""
    fxshard_lowered, inductor, _ = training_step[program]
    assert all(compute == 0 for _, compute in fxshard_lowered), fxshard_lowered
    assert [kind for kind, compute in inductor if compute > 0] == overlapped, inductor


@pytest.mark.parametrize("program, unpacked", [
    ("forward", 2),   # a bucket of two weights per block
    ("backward", 1),  # the last block's two weights regathered as one bucket; the first block's one weight alone
])
def test_a_gathered_bucket_is_unpacked_by_one_call(training_step, program, unpacked):
    """``backend/inductor/bucket_copies.py``: every member of a gathered bucket comes out of it in one
    ``fxshard::unpack_gathered`` call (Inductor's default merge would generate a copy kernel per member)."""
    _, inductor, lines = training_step[program]
    unpacks = [s for s in lines if "fxshard.unpack_gathered" in s]
    assert counts(inductor)["all_gather"] == 2 and len(unpacks) == unpacked, unpacks


def test_unpack_gathered_gives_every_ranks_piece_of_each_member():
    """What an all_gather of a packed bucket holds, rank after rank (each rank's members back to back),
    comes out member by member in the shape asked for: a gathered member's own (its ranks' pieces stacked
    on dim 0), or ``(ranks, numel)``; its fake implementation agrees (``opcheck``)."""
    from fxshard.backend.inductor import bucket_copies  # noqa: F401  (registers the op)

    ranks, shards = 3, [(5,), (1,), (2, 3), (7,)]  # each rank's shard of each member
    numels = [math.prod(s) for s in shards]
    shapes = [(ranks * 5,), (ranks, 1), (ranks * 2, 3), (ranks, 7)]  # members 1 and 3 as (ranks, numel)
    pieces = [[torch.randn(s) for s in shards] for _ in range(ranks)]  # rank r's shard of member k
    gathered = torch.cat([torch.cat([x.flatten() for x in p]) for p in pieces])
    arguments = (gathered, ranks, numels, [n for s in shapes for n in s], [len(s) for s in shapes])
    members = torch.ops.fxshard.unpack_gathered(*arguments)
    torch.testing.assert_close(members, [torch.cat([p[k] for p in pieces]).reshape(shapes[k])
                                         for k in range(len(shards))])
    torch.library.opcheck(torch.ops.fxshard.unpack_gathered.default, arguments)


def test_bucketing_false_leaves_each_collective_and_its_wait(fake_mesh_4):
    """``options={"bucketing": False}``: Inductor compiles the collectives fxshard lowered, one per
    weight (the forward alone: no gradient is recorded)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN)
    shard_parameters(model, fake_mesh_4)
    compiled = torch.compile(model, backend="fxshard", options={"cost_model": COST, "bucketing": False,
                                                                "regional": False})
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    with torch.no_grad():
        _, (code,) = run_and_get_code(compiled, x)
    # one gather per weight, none bucketed (the sum stays a Partial DTensor: no all_reduce); Inductor's
    # default order may still start a gather before the previous one's wait, as each reads a parameter
    assert [kind for kind, _ in collectives(statements(code))] == ["all_gather"] * 4


@pytest.fixture(scope="module")
def uneven_programs() -> tuple[dict, tuple[str, ...]]:
    """Every rank's lowered training program of ``Blocks`` with 30 and 62 rows on 4 ranks (8, 8, 8, 6
    and 16, 16, 16, 14): rank 3's local program has other shapes than the others'; and the names of
    the parameters whose gradients the backward returns."""
    torch.manual_seed(0)
    model = Blocks(dim=30, hidden=62)
    placements = {name: (Shard(0),) for name, _ in model.named_parameters()} | {0: (Shard(0),)}
    with fake_world(fxshard.MeshSpec(dp=4)) as device_mesh:
        programs = lowered_graphs(model, torch.randn(TOKENS, 30), device_mesh=device_mesh, placements=placements,
                                  grad=True, cost_model=COST)
    return programs, tuple(name.replace(".", "_") for name, _ in model.named_parameters())


def test_buckets_are_the_same_on_every_rank_of_an_uneven_program(uneven_programs):
    """The block buckets of each rank's program (``backend/inductor/buckets.py``: tags from names, grouped in
    program order): the same collectives in the same buckets on every rank (a rank that bucketed
    otherwise would hang the job), though rank 3's shards are smaller."""
    def shapes(gm: torch.fx.GraphModule) -> list:
        return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]

    def buckets(gm: torch.fx.GraphModule, grads: tuple) -> list[list[str]]:
        tag_blocks(gm, grads)
        tagged = [n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get(BLOCK_KEY)]
        return [[n.name for n in bucket] for bucket in block_buckets(tagged, lambda n: (n.target, n.meta["custom"][BLOCK_KEY]))]

    programs, grads = uneven_programs
    per_rank = {c: [buckets(forward, ()), buckets(backward, grads)] for c, (forward, backward) in programs.items()}
    assert shapes(programs[(0,)][0]) != shapes(programs[(3,)][0])
    assert all(b == per_rank[(0,)] for b in per_rank.values()), per_rank
    # forward: a gather per block; backward: the last block's two weights regathered, a reduce_scatter per
    # block (the first block regathers one weight, its input needing no gradient: no bucket of one)
    assert [[len(bucket) for bucket in b] for b in per_rank[(0,)]] == [[2, 2], [2, 2, 2]]


def test_a_collective_that_depends_on_its_bucket_starts_the_next():
    """Block buckets are cut before a collective whose input comes from an earlier one of its bucket."""
    graph = torch.fx.Graph()
    gather, wait = torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default
    w0, w2 = graph.placeholder("layers_0_a_weight"), graph.placeholder("layers_0_b_weight")
    g0 = graph.call_function(gather, (w0, 4, "0"))
    g1 = graph.call_function(gather, (graph.call_function(wait, (g0,)), 4, "0"))  # gathers g0's result again
    g2 = graph.call_function(gather, (w2, 4, "0"))
    graph.output([graph.call_function(wait, (g,)) for g in (g1, g2)])
    assert block_buckets([g0, g1, g2], lambda n: "layers_0") == [[g1, g2]]


@pytest.mark.parametrize("owned", [True, False], ids=["graph-module", "bare-graph"])
def test_nodes_made_are_the_new_nodes_still_in_the_graph(owned):
    """``nodes_made``: the nodes a merge added and kept, told by the module as they are made, or by comparing
    a graph no module owns before and after."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    kept = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(kept)
    module = torch.fx.GraphModule(torch.nn.Module(), graph) if owned else None
    graph = module.graph if owned else graph
    kept = next(n for n in graph.nodes if n.op == "call_function")
    with nodes_made(graph) as made:
        with graph.inserting_after(kept):
            gone = graph.call_function(torch.ops.aten.neg.default, (kept,))
            new = graph.call_function(torch.ops.aten.exp.default, (kept,))
        graph.erase_node(gone)
        assert made == []  # filled on leaving the block
    assert made == [new]


@pytest.mark.parametrize("ranks, same_key", [
    (((0,), (1,)), True),    # the same local program: one cache entry serves both
    (((0,), (3,)), False),   # rank 3's smaller shards: a program of its own
])
def test_ranks_share_an_inductor_cache_entry_only_for_the_same_program(uneven_programs, ranks, same_key):
    """Inductor's FX graph cache key covers the graph (its code and shapes) and this config, not the rank."""
    from torch._inductor import config, config_comms
    from torch._inductor.codecache import compiled_fx_graph_hash

    programs, _ = uneven_programs
    keys = []
    for c in ranks:
        forward = programs[c][0]
        patches, comms = inductor_patches(BucketPolicy(block_bytes(forward)), tag_blocks(forward))
        with config.patch(patches), config_comms.patch(comms):
            inputs = [n.meta["val"] for n in forward.graph.nodes if n.op == "placeholder"]
            keys.append(compiled_fx_graph_hash(forward, inputs, {}, [])[0])
    assert (keys[0] == keys[1]) == same_key


@pytest.mark.parametrize("model, placements, expected", [
    # the largest block: layers.0 gathers up [64, 32] and down [32, 64]; layers.1 the same
    (Blocks(DIM, HIDDEN), "every", 2 * HIDDEN * DIM * 4),
    # no indexed modules: the whole model is one block (an MLP's two weights)
    (MLPBlock(DIM, HIDDEN), "every", 2 * HIDDEN * DIM * 4),
    # no parameter moves (replicated weights, data parallel forward): Inductor's default cap
    (Blocks(DIM, HIDDEN), "none", 2000 * 2**20),
])
def test_a_bucket_holds_one_block(model, placements, expected):
    placements = {name: (Shard(0),) for name, _ in model.named_parameters()} if placements == "every" else {}
    with fake_world(fxshard.MeshSpec(dp=4)) as device_mesh:
        programs = lowered_graphs(model, torch.randn(TOKENS, DIM), device_mesh=device_mesh,
                                  placements=placements | {0: (Shard(0),)}, cost_model=COST)
    forward = programs[(0,)]
    assert block_bytes(forward) == expected


@pytest.mark.parametrize("inductor", [False, True])
@pytest.mark.parametrize("block", [True, False])
def test_a_gather_bucket_of_several_dtypes_is_one_call_and_gives_each_member_back(fake_mesh_4, inductor, block):
    """Token ids (int64), activations (float32) and a mask (as uint8) gathered on one group are one bucket
    (``bucket_copies.gather_key``): one all_gather of the members' bytes, each member viewed back as its
    dtype; as one block's (each gathers a graph input: ``tag_blocks``) or as no block's (each computed from
    two inputs: bucketed greedily). On the fake group nothing arrives from the other ranks, so rank 0's
    piece of each gathered member is what packing put there: it must be its input, bit for bit (an odd
    number of int64s between float32s and bytes: the offsets are in the narrowest dtype's units)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxshard.backend.inductor.compile_local import bucketed_uncompiled, compile_local

    fake = FakeTensorMode()
    c10d = torch.ops._c10d_functional
    group = fake_mesh_4.get_group().group_name
    values = [torch.tensor([3, -100, 2**40 + 7]), torch.randn(5, 2), torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.uint8)]
    graph, inputs, waits = torch.fx.Graph(), [], []
    for name, x in zip(("ids", "hidden", "mask"), values):
        gathered = graph.placeholder(name)
        gathered.meta["val"] = fake.from_tensor(x)
        inputs.append(x)
        if not block:  # x - zeros: a value of two inputs, of no block
            zeros = graph.placeholder(f"{name}_zeros")
            zeros.meta["val"] = fake.from_tensor(x)
            inputs.append(torch.zeros_like(x))
            gathered = graph.call_function(torch.ops.aten.sub.Tensor, (gathered, zeros))
            gathered.meta["val"] = fake.from_tensor(x)
        gather = graph.call_function(c10d.all_gather_into_tensor.default, (gathered, 4, group))
        with fake:
            gather.meta["val"] = torch.empty(4 * x.shape[0], *x.shape[1:], dtype=x.dtype)
        wait = graph.call_function(c10d.wait_tensor.default, (gather,))
        wait.meta["val"] = gather.meta["val"]
        waits.append(wait)
    graph.output(tuple(waits))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    policy = BucketPolicy(cap=2**20)
    run = compile_local(gm, inputs, policy) if inductor else bucketed_uncompiled(gm, policy)
    if not inductor:
        gathers = [str(n.target) for n in gm.graph.nodes if str(n.target).startswith("_c10d_functional.all_gather")]
        assert gathers == ["_c10d_functional.all_gather_into_tensor_out.default"], gathers
    outs = run(*inputs)
    for x, out in zip(values, outs):
        assert out.dtype == x.dtype and out.shape == (4 * x.shape[0], *x.shape[1:])
        assert torch.equal(out[:x.shape[0]], x)


class NormMLPBlock(torch.nn.Module):
    """A Llama MLP in miniature: RMSNorm, then up, relu and down, and the residual."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


@pytest.fixture(scope="module")
def tensor_parallel_step(fake_mesh_4):
    """{program: (fxshard's lowered collectives, Inductor's)} of a Megatron-style training step: two
    ``NormMLPBlock``s, ``up`` column-parallel (Shard(0)), ``down`` row-parallel (Shard(1)), the norms'
    weights and the batch replicated; whole programs."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = torch.nn.Sequential(NormMLPBlock(64, 256), NormMLPBlock(64, 256))
    for name, _ in list(model.named_parameters()):
        shard_parameters(model.get_submodule(name.rpartition(".")[0]), fake_mesh_4,
                         {"up": (Shard(0),), "down": (Shard(1),)}.get(name.split(".")[1], (Replicate(),)))
    lowered: dict = {}
    options = {"regional": False, "on_graph": lambda stage, gm: lowered.setdefault(stage, lowered_collectives(gm))
               if stage.startswith("lower") else None}
    compiled = torch.compile(model, backend="fxshard", options=options)
    x = distribute_tensor(torch.randn(8, 64), fake_mesh_4, [Replicate()])  # few tokens: activations move, not weights

    def step() -> None:
        compiled(x).sum().backward()
    _, (forward, backward) = run_and_get_code(step)
    return {"forward": (lowered["lower"], collectives(statements(forward))),
            "backward": (lowered["lower_backward"], collectives(statements(backward)))}


@pytest.mark.parametrize("program, compiled", [
    # each block's output reduced: the next block reads it, nothing else is left to compute meanwhile
    ("forward", [("all_reduce", 0), ("all_reduce", 0)]),
    # each block's input gradient (up's partial sums) reduced while the block's two weight gradients
    # compute (Megatron's asynchronous all-reduce); Inductor alone: 0 and 4 (the second block's weight
    # gradients left behind the first wait, all four under the last; in a Llama layer 0 and 0: the norm's
    # recomputed output, which up's weight gradient reads, fused with the norm's backward behind the wait)
    ("backward", [("all_reduce", 2), ("all_reduce", 2)]),
])
def test_a_lone_all_reduce_overlaps_the_compute_that_does_not_need_it(tensor_parallel_step, program, compiled):
    """``backend/inductor/collective_windows.py``: fxshard lowers each wait right behind its all_reduce; in Inductor's code
    the matmuls that neither feed an all_reduce nor read its result run between its start and its wait."""
    fxshard_lowered, inductor = tensor_parallel_step[program]
    assert [(kind, compute) for kind, compute in fxshard_lowered] == [(kind, 0) for kind, _ in compiled]
    assert inductor == compiled


def test_a_kernel_goes_to_the_first_window_it_fits_and_a_bucketable_all_reduce_gets_none():
    """``collective_windows`` on a graph of its own: two chained all_reduces (the second reduces what the first
    gave) and three matmuls: one feeding the first, one free of both (the first window's), one reading the
    first's result (the second window's). Each window's kernel comes to lie between its start and wait. Then
    a graph of two independent all_reduces (Inductor may bucket the two): neither gets a window."""
    from fxshard.backend.inductor.collective_windows import collective_windows

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    mm = lambda x, y: graph.call_function(aten.mm.default, (x, y))  # noqa: E731

    def reduce(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
        start = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
        return start, graph.call_function(c10d.wait_tensor.default, (start,))
    free = mm(b, b)  # before both starts in program order
    fed = mm(a, b)
    first, first_wait = reduce(fed)
    reads = mm(first_wait, b)
    second, second_wait = reduce(reads)
    late = mm(first_wait, a)
    graph.output([free, second_wait, late])
    windows = collective_windows(torch.fx.GraphModule(torch.nn.Module(), graph).graph)  # its edges need a module
    assert {start.name: [k.name for k in kernels] for start, kernels in windows.items()} == \
        {first.name: [free.name], second.name: [late.name]}
    order = [n.name for n in graph.nodes]
    assert order.index(first.name) < order.index(free.name) < order.index(first_wait.name)
    assert order.index(second.name) < order.index(late.name) < order.index(second_wait.name)
    graph.lint()

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first, first_wait = reduce(mm(a, b))
    second, second_wait = reduce(mm(b, a))  # independent of the first: a bucket for Inductor
    graph.output([first_wait, second_wait, mm(b, b)])
    assert collective_windows(torch.fx.GraphModule(torch.nn.Module(), graph).graph) == {}


def test_no_window_makes_a_collective_start_before_one_that_started_before_it():
    """A matmul free of an all_reduce's data but reading a gather issued after a later all_reduce gets no
    window: in the first's it would pull the gather before the second all_reduce (each rank must issue
    collectives in one order), in the second's likewise."""
    from fxshard.backend.inductor.collective_windows import collective_windows

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first = graph.call_function(c10d.all_reduce.default, (graph.call_function(aten.mm.default, (a, b)), "sum", "0"))
    first_wait = graph.call_function(c10d.wait_tensor.default, (first,))
    second = graph.call_function(c10d.all_reduce.default, (first_wait, "sum", "0"))
    second_wait = graph.call_function(c10d.wait_tensor.default, (second,))
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (b, 4, "0"))
    late = graph.call_function(aten.mm.default, (graph.call_function(c10d.wait_tensor.default, (gather,)), a))
    graph.output([second_wait, late])
    issued = [first, second, gather]
    assert collective_windows(torch.fx.GraphModule(torch.nn.Module(), graph).graph) == {}
    assert [n for n in graph.nodes if n in issued] == issued


@pytest.fixture(scope="module")
def sequence_parallel_step(fake_mesh_4):
    """{program: Inductor's collectives} of a training step of two ``SwiGLUBlock``s under torchtitan's
    tensor + sequence parallel plan (``rank_programs.sequence_parallel``); whole programs. Numerics on gloo
    ranks: tests/test_e2e_gloo.py."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = torch.nn.Sequential(SwiGLUBlock(64, 256), SwiGLUBlock(64, 256))
    sequence_parallel(model, fake_mesh_4)
    compiled = torch.compile(model, backend="fxshard", options={"regional": False})
    x = distribute_tensor(torch.randn(32, 64), fake_mesh_4, [Shard(0)])

    def step() -> None:
        compiled(x).sum().backward()
    _, (forward, backward) = run_and_get_code(step)
    return {"forward": collectives(statements(forward)), "backward": collectives(statements(backward))}


@pytest.mark.parametrize("program, compiled", [
    # each block: the tokens gathered for gate and up, down's partial sums reduce_scattered to the token
    # shards; each reads the one before, nothing is left to compute meanwhile
    ("forward", [("all_gather", 0), ("reduce_scatter", 0)] * 2),
    # the output's gradient gathered (none before it), the second block's input gradient reduce_scattered,
    # the norms' weight gradients all-reduced (one bucket), the residual's gradient gathered for the first
    # block, the first block's input gradient reduce_scattered. The second block's three weight gradients
    # run while the gather for the first block is in flight (the reduce_scatter before it leads to it
    # through the norm's backward alone); the first block's three while the norms' all_reduce is (they go
    # to the last reduce_scatter's window, whose successor is no lone collective; Inductor raises the
    # all_reduce over them). Inductor alone: none anywhere (the weight gradients come before each
    # reduce_scatter's start in its order)
    ("backward", [("all_gather", 0), ("reduce_scatter", 0), ("all_gather", 3), ("reduce_scatter", 0),
                  ("all_reduce", 3)]),
])
def test_sequence_parallel_gathers_overlap_the_compute_that_does_not_need_them(sequence_parallel_step, program,
                                                                               compiled):
    """``backend/inductor/collective_windows.py`` with sequence parallelism: a lone reduce_scatter or all_gather gets
    the matmuls that neither feed it nor read its result, where Inductor's own reordering keeps them there."""
    assert sequence_parallel_step[program] == compiled


def test_a_collective_that_leads_straight_to_another_leaves_its_kernels_to_the_second():
    """A reduce_scatter whose result reaches an all_gather through elementwise nodes alone (TP + SP's
    backward: the norm's backward between them) gets no window: Inductor's reordering would raise the
    gather, and the reduce_scatter's wait with it, over any kernel in between. The free matmul goes to the
    gather's window. When what follows is not lone (two all_reduces Inductor may bucket), the reduce_scatter
    keeps its window."""
    from fxshard.backend.inductor.collective_windows import collective_windows

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten

    def program(then_gather: bool) -> tuple[torch.fx.Graph, dict, torch.fx.Node, list[torch.fx.Node], list[str]]:
        """(graph, its windows, the free matmul, [the reduce_scatter, what follows it], the latter's waits' names)."""
        graph = torch.fx.Graph()
        a, b = graph.placeholder("a"), graph.placeholder("b")
        start = graph.call_function(c10d.reduce_scatter_tensor.default,
                                    (graph.call_function(aten.mm.default, (a, b)), "sum", 4, "0"))
        scattered = graph.call_function(aten.mul.Tensor, (graph.call_function(c10d.wait_tensor.default, (start,)), 2))
        free = graph.call_function(aten.mm.default, (b, b))
        if then_gather:
            after = [graph.call_function(c10d.all_gather_into_tensor.default, (scattered, 4, "0"))]
        else:
            after = [graph.call_function(c10d.all_reduce.default, (scattered, "sum", "0")),
                     graph.call_function(c10d.all_reduce.default, (b, "sum", "0"))]
        waits = [graph.call_function(c10d.wait_tensor.default, (n,)) for n in after]
        graph.output([free, *waits])
        names = [w.name for w in waits]
        windows = collective_windows(torch.fx.GraphModule(torch.nn.Module(), graph).graph)
        graph.lint()
        return graph, windows, free, [start, *after], names

    graph, windows, free, (_, gather), (gathered,) = program(then_gather=True)
    assert windows == {gather: [free]}
    order = [n.name for n in graph.nodes]  # the window's nodes are replaced by Inductor's control_deps, named as they were
    assert order.index(gather.name) < order.index(free.name) < order.index(gathered)
    _, windows, free, (scatter, *_), _ = program(then_gather=False)
    assert windows == {scatter: [free]}
