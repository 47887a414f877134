"""Load-time sharding: every rank's block read straight from the checkpoint equals the block of the
full tensor under its layout, on any mesh, reading no more than its own bytes."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard.load import Checkpoint, LoadError, ShardPlan, load_sharded, read_shards, register_transform
from fxshard.placements import layout_from_placements

safetensors_torch = pytest.importorskip("safetensors.torch")

TENSORS = {  # name: (shape, placements on a 1-D mesh)
    "embed": ((48, 16), (Shard(0),)),
    "wo": ((16, 24), (Shard(1),)),
    "norm": ((16,), (Replicate(),)),
    # fused q|k|v [3 * 24, 16] with heads sharded inside each of q, k, v: [3 · tp · 24/tp] rows
    "wqkv": ((72, 16), (_StridedShard(0, split_factor=3),)),
    # gate|up [2 * 24, 16] the same way
    "w13": ((48, 16), (_StridedShard(0, split_factor=2),)),
    "uneven": ((10, 3), (Shard(0),)),
    "cube": ((4, 6, 8), (Shard(1),)),  # strided reads: 4 x (6/n rows of 8)
    "scalar": ((), (Replicate(),)),
}
MESHES = [fxshard.MeshSpec(tp=n) for n in (1, 2, 4, 8)] + [fxshard.MeshSpec(dp=2, tp=2)]


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {name: torch.randn(shape) for name, (shape, _) in TENSORS.items()}
    out["cube"] = out["cube"].bfloat16()
    return out


@pytest.fixture(scope="module", params=["safetensors", "torch.save"])
def checkpoint(request, full, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / ("model.safetensors" if request.param == "safetensors" else "model.pt")
    if request.param == "safetensors":
        safetensors_torch.save_file(full, str(path))
    else:
        torch.save(full, path)
    return path


def placements_on(mesh: fxshard.MeshSpec, placements) -> tuple:
    return (Replicate(),) * (len(mesh.names) - 1) + tuple(placements)  # 2-D: dp replicated, tp as given


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_rank_reads_its_block(checkpoint, full, mesh):
    specs = {name: (placements_on(mesh, p), ()) for name, (_, p) in TENSORS.items()}
    for coordinate in mesh.coordinates():
        ckpt = Checkpoint(checkpoint)
        blocks = read_shards(ckpt, specs, mesh, coordinate)
        for name, block in blocks.items():
            layout = layout_from_placements(mesh, full[name].shape, specs[name][0])
            torch.testing.assert_close(block, layout.shard(full[name], coordinate), rtol=0, atol=0)
        # a rank reads exactly its blocks: no full tensor, no slack (for safetensors: bytes from the file)
        assert ckpt.bytes_read == sum(b.numel() * b.element_size() for b in blocks.values())
        if str(checkpoint).endswith(".safetensors") and mesh.world_size > 1:
            assert ckpt.bytes_read < sum(t.numel() * t.element_size() for t in full.values())


def test_strided_fused_qkv_gives_each_rank_its_heads_of_q_k_and_v(full):
    mesh = fxshard.MeshSpec(tp=2)
    block = read_shards(full, {"wqkv": ((_StridedShard(0, split_factor=3),), ())}, mesh, (1,))["wqkv"]
    q, k, v = full["wqkv"].chunk(3)
    torch.testing.assert_close(block, torch.cat([q[12:], k[12:], v[12:]]))


def test_plan_round_trips_through_json_and_applies_transforms(full):
    register_transform("times_two", lambda t: t * 2)
    plan = ShardPlan.of({"w*": {"placements": "SS(0;3)", "transforms": ["times_two", "bfloat16"]},
                         "embed": [Shard(0)]})
    again = ShardPlan.from_json(plan.to_json())
    assert again == plan and "tp" not in plan.to_json()  # never mentions the ranks
    entry = again.lookup("wqkv")
    block = read_shards(full, {"wqkv": (entry.placements, entry.transforms)}, fxshard.MeshSpec(tp=2), (0,))["wqkv"]
    assert block.dtype == torch.bfloat16
    q, k, v = full["wqkv"].chunk(3)
    torch.testing.assert_close(block, (torch.cat([q[:12], k[:12], v[:12]]) * 2).bfloat16())


@pytest.mark.parametrize("specs, message", [
    ({"missing": ((Shard(0),), ())}, "no tensor for \\['missing'\\]"),
    ({"embed": ((Shard(2),), ())}, "embed: placements S\\(2\\)"),
    ({"embed": ((Shard(0),), ("no_such_transform",))}, "embed: transform 'no_such_transform' is not registered"),
])
def test_bad_input_names_the_parameter(full, specs, message):
    with pytest.raises(LoadError, match=message):
        read_shards(full, specs, fxshard.MeshSpec(tp=2), (0,))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


def test_load_sharded_fills_a_meta_module_with_dtensors(tmp_path):
    from torch.distributed.tensor import DTensor

    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    reference = Tiny()
    path = tmp_path / "tiny.safetensors"
    safetensors_torch.save_file(reference.state_dict(), str(path))
    with torch.device("meta"):
        model = Tiny()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        load_sharded(model, path, mesh, plan={"up.weight": "S(0)", "down.weight": "S(1)"})
        assert isinstance(model.up.weight, DTensor) and model.up.weight.placements == (Shard(0),)
        torch.testing.assert_close(model.up.weight.to_local(), reference.up.weight.detach()[:8])  # rank 0
        torch.testing.assert_close(model.down.weight.to_local(), reference.down.weight.detach()[:, :8])
        assert model.up.weight.requires_grad
        # a plain tensor of the module that the plan does not name stays plain, whole on every rank (TP
        # leaves norms plain, and DTensors mixed with plain tensors fail in DTensor)
        assert type(model.scale) is torch.Tensor and torch.equal(model.scale, reference.scale)
        with torch.device("meta"):
            model = Tiny()
        load_sharded(model, path, mesh, plan={"scale": "R"})  # named by the plan: a replicated DTensor
        assert isinstance(model.scale, DTensor) and model.scale.placements == (Replicate(),)


def test_load_sharded_checks_everything_before_assigning(tmp_path):
    from fxshard.backend.simulate import fake_world

    state = Tiny().state_dict()
    state["up.weight"] = torch.randn(31, 16)  # wrong shape
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with torch.device("meta"):
        model = Tiny()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with pytest.raises(LoadError, match="up.weight: the checkpoint holds shape \\[31, 16\\]"):
            load_sharded(model, path, mesh, plan={"up.weight": "S(0)"})
        assert model.down.weight.is_meta  # nothing was assigned
        state["extra"] = torch.zeros(1)
        del state["up.weight"]
        torch.save(state, path)
        with pytest.raises(LoadError, match="no tensor for \\['up.weight'\\]|does not: \\['extra'\\]"):
            load_sharded(model, path, mesh)


def test_hugging_face_style_directory_of_shards(full, tmp_path):
    """model-0000x-of-00002.safetensors + model.safetensors.index.json (the weight_map)."""
    import json

    names = sorted(full)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_torch.save_file({n: full[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    mesh = fxshard.MeshSpec(tp=4)
    specs = {name: (p, ()) for name, (_, p) in TENSORS.items()}
    blocks = read_shards(tmp_path, specs, mesh, (2,))
    for name, block in blocks.items():
        torch.testing.assert_close(block, layout_from_placements(mesh, full[name].shape, specs[name][0]).shard(
            full[name], (2,)), rtol=0, atol=0)


def test_dcp_directory_loads_through_dcp(tmp_path):
    """A torch.distributed.checkpoint directory: DCP itself reads into this rank's DTensor shards."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    reference = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(reference.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    with torch.device("meta"):
        model = Tiny()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        load_sharded(model, tmp_path, mesh, plan={"up.weight": "S(0)", "down.weight": "S(1)"})
        torch.testing.assert_close(model.up.weight.to_local(), reference.up.weight.detach()[:8])
        torch.testing.assert_close(model.down.weight.to_local(), reference.down.weight.detach()[:, :8])
        torch.testing.assert_close(model.scale, reference.scale)  # plain in the module: plain, whole


class SeparateQKV(torch.nn.Module):
    """q, k, v (grouped-query: 8 q heads, 2 kv heads of 4) and gate, up as separate parameters."""

    def __init__(self, dim: int = 16, head: int = 4):
        super().__init__()
        self.wq = torch.nn.Parameter(torch.empty(8 * head, dim))
        self.wk = torch.nn.Parameter(torch.empty(2 * head, dim))
        self.wv = torch.nn.Parameter(torch.empty(2 * head, dim))
        self.w1 = torch.nn.Parameter(torch.empty(24, dim))
        self.w3 = torch.nn.Parameter(torch.empty(24, dim))


GQA_PLAN = {
    "wq": {"placements": "S(0)", "source": {"name": "wqkv", "dim": 0, "offset": 0}},
    "wk": {"placements": "S(0)", "source": {"name": "wqkv", "dim": 0, "offset": 32}},
    "wv": {"placements": "S(0)", "source": {"name": "wqkv", "dim": 0, "offset": 40}},
    "w1": {"placements": "S(0)", "source": {"name": "w13", "dim": 0, "offset": 0}},
    "w3": {"placements": "S(0)", "source": {"name": "w13", "dim": 0, "offset": 24}},
}


@pytest.mark.parametrize("tp", [1, 2])
def test_grouped_query_fused_qkv_loads_each_part_sharded_on_its_own(tmp_path, tp):
    """wqkv = [q (8 heads) | k (2) | v (2)] and w13 = [gate | up] in the checkpoint; the module's
    q, k, v, gate, up each get this rank's heads / rows, read straight from the fused tensors."""
    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    fused = {"wqkv": torch.randn(48, 16), "w13": torch.randn(48, 16)}
    path = tmp_path / "fused.safetensors"
    safetensors_torch.save_file(fused, str(path))
    plan = ShardPlan.from_json(ShardPlan.of(GQA_PLAN).to_json())
    with torch.device("meta"):
        model = SeparateQKV()
    with fake_world(fxshard.MeshSpec(tp=tp)) as mesh:
        load_sharded(model, path, mesh, plan=plan)
    q, k, v = fused["wqkv"].split([32, 8, 8])
    gate, up = fused["w13"].chunk(2)
    for param, whole in ((model.wq, q), (model.wk, k), (model.wv, v), (model.w1, gate), (model.w3, up)):
        assert param.shape == whole.shape
        torch.testing.assert_close(param.to_local(), whole.chunk(tp)[0], rtol=0, atol=0)  # rank 0's rows
    ckpt = Checkpoint(path)
    specs = {n: fxshard.load.TensorSpec(e.placements, e.transforms, e.source)
             for n in GQA_PLAN for e in [plan.lookup(n)]}
    read_shards(ckpt, specs, fxshard.MeshSpec(tp=2), (1,), expected_shapes={n: p.shape for n, p in model.named_parameters()})
    assert ckpt.bytes_read == sum(t.numel() * 4 for t in fused.values()) // 2  # half of each part, nothing more


def test_a_part_that_does_not_fit_its_fused_tensor_is_an_error(tmp_path):
    from fxshard.backend.simulate import fake_world

    path = tmp_path / "fused.safetensors"
    safetensors_torch.save_file({"wqkv": torch.randn(40, 16), "w13": torch.randn(48, 16)}, str(path))
    with torch.device("meta"):
        model = SeparateQKV()
    with fake_world(fxshard.MeshSpec(tp=2)) as mesh:
        with pytest.raises(LoadError, match="wv: shape \\[8, 16\\] at offset 40 of dim 0 does not fit in wqkv"):
            load_sharded(model, path, mesh, plan=GQA_PLAN)


def test_reader_follows_the_safetensors_format_itself(tmp_path):
    """The reader needs neither the safetensors package nor numpy: header length, JSON header, raw data."""
    import json
    import struct

    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F32", "shape": [4, 6], "data_offsets": [0, 96]}}).encode()
    path = tmp_path / "hand.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(t.untyped_storage()))
    ckpt = Checkpoint(path)
    assert ckpt.keys() == ["w"] and ckpt.shape("w") == (4, 6)
    torch.testing.assert_close(ckpt.read("w", [[(1, 3)], [(2, 5)]]), t[1:3, 2:5])
    assert ckpt.bytes_read == 2 * 3 * 4


class TinyWithHead(torch.nn.Module):
    """Tiny with a biased head and a non-persistent buffer (a rotary table's kind: in no state dict)."""

    def __init__(self):
        super().__init__()
        self.body = Tiny()
        self.head = torch.nn.Linear(16, 8)
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def save_dcp(state: dict, path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def training_state(model: torch.nn.Module) -> dict:
    """What a training loop saves: the model's state and its optimizer's, one step taken (its moments exist)."""
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.body(torch.randn(2, 16))).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def test_dcp_save_of_model_and_optimizer_loads_through_the_model_prefix(tmp_path):
    """{"model": model.state_dict(), "optim": ...}: DCP keys the module's tensors 'model.head.bias'; the one prefix
    holding every name the module has is read through, the optimizer's keys are not the module's (strict passes)."""
    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    reference = TinyWithHead()
    save_dcp(training_state(reference), tmp_path)
    with torch.device("meta"):
        model = TinyWithHead()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        load_sharded(model, tmp_path, mesh, plan={"body.up.weight": "S(0)", "head.weight": "S(1)"})
        torch.testing.assert_close(model.body.up.weight.to_local(), reference.body.up.weight.detach()[:8])
        torch.testing.assert_close(model.head.weight.to_local(), reference.head.weight.detach()[:, :4])
        torch.testing.assert_close(model.head.bias, reference.head.bias.detach())
        assert model.table.is_meta  # non-persistent: the module's own, not asked of the checkpoint


@pytest.mark.parametrize("saved, message", [
    # several prefixes hold every name: the message lists them, prefix= chooses
    ("twice", "under several prefixes: pass one of prefix='ema.', prefix='model.'"),
    # the prefix holds some of the names: the message names it and the fix
    ("partial", r"its keys carry a prefix the module's names lack, 'model.' \(e\.g\. 'model\.body\.down\.weight'.*"
                r"under it the checkpoint has no tensor for \['model\.body\.up\.weight', 'model\.head\.bias', "
                r"'model\.head\.weight'\] either \(2 of the 5 are there\).*prefix='model\.' reads it once"),
])
def test_a_prefix_that_does_not_settle_it_is_named_with_its_fix(tmp_path, saved, message):
    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    reference = TinyWithHead()
    state = {k: v for k, v in reference.state_dict().items() if saved == "twice" or not k.startswith("head.")}
    state["body.up.weight_renamed"] = state.pop("body.up.weight")
    nested = {"model": state, "ema": state} if saved == "twice" else {"model": state}
    if saved == "twice":
        state["body.up.weight"] = state.pop("body.up.weight_renamed")
    save_dcp(nested, tmp_path)
    with torch.device("meta"):
        model = TinyWithHead()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with pytest.raises(LoadError, match=message):
            load_sharded(model, tmp_path, mesh, plan={"body.up.weight": "S(0)"})
        if saved == "twice":  # following the message loads
            load_sharded(model, tmp_path, mesh, plan={"body.up.weight": "S(0)"}, prefix="ema.")
            torch.testing.assert_close(model.body.up.weight.to_local(), reference.body.up.weight.detach()[:8])


def test_torch_save_with_a_prefix_loads_through_it(tmp_path):
    """A torch.save of a wrapper's state ({"model.body.up.weight": ...}): the same prefix reading as DCP's."""
    from fxshard.backend.simulate import fake_world

    torch.manual_seed(0)
    reference = TinyWithHead()
    torch.save({"model." + k: v for k, v in reference.state_dict().items()}, tmp_path / "wrapped.pt")
    with torch.device("meta"):
        model = TinyWithHead()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        load_sharded(model, tmp_path / "wrapped.pt", mesh, plan={"body.down.weight": "S(1)"})
        torch.testing.assert_close(model.body.down.weight.to_local(), reference.body.down.weight.detach()[:, :8])


def test_transformers_tp_plan_reads_as_parameter_placements():
    """transformers' ``model.tp_plan`` (style names per module pattern) as the placements its styles give."""
    plan = ShardPlan.from_tp_plan({"model.layers.*.self_attn.q_proj": "colwise",
                                   "model.layers.*.self_attn.o_proj": "rowwise",
                                   "model.embed_tokens": "embedding_rowwise", "model.norm": "sequence_parallel"})
    looked_up = {n: (e.placements if (e := plan.lookup(n)) else None) for n in (
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.o_proj.weight", "model.layers.3.self_attn.o_proj.bias",
        "model.embed_tokens.weight", "model.norm.weight")}
    assert looked_up == {"model.layers.3.self_attn.q_proj.weight": (Shard(0),),
                         "model.layers.3.self_attn.q_proj.bias": (Shard(0),),
                         "model.layers.3.self_attn.o_proj.weight": (Shard(1),),
                         "model.layers.3.self_attn.o_proj.bias": None, "model.embed_tokens.weight": (Shard(0),),
                         "model.norm.weight": None}
    with pytest.raises(LoadError, match="'moe_tp_experts' has no parameter placements"):
        ShardPlan.from_tp_plan({"model.layers.*.mlp.experts": "moe_tp_experts"})
