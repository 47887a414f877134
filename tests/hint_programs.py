"""Rank programs for tests/test_hints.py: a model parallelized by transformers' own tensor parallelism, and
the program fxshard's message says to write instead, on spawned gloo ranks (examples/ranks.py)."""
from __future__ import annotations

import torch


class Logits(torch.nn.Module):
    """``model(input_ids=ids, use_cache=False).logits``: the module fxshard.compile takes."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def tiny_llama() -> torch.nn.Module:
    """A 1-layer grouped-query Llama from a small config, its weights from seed 0 (the same on every rank)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def transformers_tp_then_the_fix(rank: int, world_size: int, device: str = "cpu") -> dict:
    """transformers' TP (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))``'s own steps:
    from_pretrained itself asks for accelerate) compiled by fxshard: the error's message; then what the message
    says to write, its logits' worst error against the single-device model on fresh random ids."""
    from transformers.distributed.configuration_utils import DistributedConfig

    import fxshard
    import fxshard.backend  # noqa: F401  (registers the backend)

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = Logits(tiny_llama())(ids)
    model = tiny_llama()
    config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(tp_size=world_size))
    model = type(model).maybe_distribute_model(model, config, meshes)
    try:
        with torch.no_grad():
            torch.compile(Logits(model), backend="fxshard")(ids)
        message = None
    except Exception as e:  # noqa: BLE001  (Dynamo wraps the backend's error)
        message = str(e)
    torch._dynamo.reset()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    model = tiny_llama()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # what from_pretrained(path) reads
    fxshard.load_sharded(model, state, mesh, plan=fxshard.ShardPlan.from_tp_plan(model.tp_plan))
    with torch.no_grad():
        logits = fxshard.compile(Logits(model))(ids)
    return {"message": message, "error": (logits.full_tensor() - reference).abs().max().item()}
