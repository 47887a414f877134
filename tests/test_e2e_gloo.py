"""End to end: torch.compile(backend="fxshard") with Inductor on real gloo ranks (127.0.0.1).

Few and bounded: each run has a timeout, so a hung collective fails the test, not CI.
"""
from __future__ import annotations

import contextlib
import pathlib
import sys
from typing import Any, Iterator

import pytest

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


@contextlib.contextmanager
def examples_and_tests_on_path() -> Iterator[None]:
    """examples/ and tests/ importable by name (spawned ranks inherit sys.path and import them so)."""
    sys.path[:0] = [str(EXAMPLES), str(HERE)]
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.path.remove(str(HERE))


def run_program(name: str, world_size: int, timeout: float, **kwargs: Any) -> dict:
    """tests/rank_programs.py's ``name`` on spawned gloo ranks (examples/ranks.py); {rank: result}."""
    with examples_and_tests_on_path():
        import rank_programs
        from ranks import spawn

        return spawn(getattr(rank_programs, name), world_size, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def mlp_tp():
    sys.path.insert(0, str(EXAMPLES))  # spawned ranks inherit sys.path and import the module by name
    try:
        import mlp_tp

        yield mlp_tp
    finally:
        sys.path.remove(str(EXAMPLES))


def test_mlp_tensor_parallel_on_two_gloo_ranks(mlp_tp):
    """On a mesh without dim names, as most DTensor docs make one: init_device_mesh("cpu", (2,))."""
    results = mlp_tp.spawn(world_size=2, timeout=600.0, mesh_kind="unnamed")
    for rank, r in sorted(results.items()):
        assert r["error"] <= 1e-5, f"rank {rank}: max abs error {r['error']:.2e} vs the single-device MLP"
        # the Megatron optimum: the row-parallel output is summed once, nothing else moves
        assert r["collectives"] == ["all_reduce.default"], f"rank {rank}: {r['collectives']}"


def test_mlp_training_through_torch_compile_on_two_gloo_ranks(mlp_tp):
    """Parameters and input require grad: the backend compiles the joint program; gradients come
    back as DTensors with their parameters' placements, and SGD steps track one device. The mesh is
    the 1-D "tp" slice of a (dp, tp) mesh."""
    from ranks import spawn

    results = spawn(mlp_tp.train, 2, 600.0, "cpu", mesh_kind="slice")
    for rank, r in sorted(results.items()):
        assert r["error"] <= 1e-5, f"rank {rank}: {r['error']:.2e}"
        assert r["placements_kept"]
        # Megatron: the row-parallel output summed forward; the input's gradient summed backward
        assert r["forward"] == ["all_reduce.default"] and r["backward"] == ["all_reduce.default"], r


def test_llama_fsdp_x_tp_training_on_four_gloo_ranks():
    """examples/train_llama.py at a small size: five (for-loop) AdamW steps of FSDP x TP (2 x 2) track the
    single-device losses; the first step's gradients match; each weight is all-gathered on dp. Five layers:
    the step is planned folded (backend/programs/fold.py: layers 0, 1, 3 and 4 planned, layer 2 stamped from layer 1)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_llama
        from models.llama import LlamaConfig

        config = LlamaConfig(vocab_size=256, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=128)
        results = train_llama.spawn(4, timeout=900.0, config=config, batch=8, seq=32, steps=5, check_grads=True,
                                     foreach=False)  # the example itself runs foreach AdamW
    finally:
        sys.path.remove(str(EXAMPLES))
    for rank, r in sorted(results.items()):
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), (rank, r["losses"], r["ref_losses"])
        assert r["grad_error"] <= 1e-4, (rank, r["grad_error"])
        assert "unfold" in r["stages"], r["stages"]  # folded
        n_params = len(list(train_llama.Llama(config).parameters()))
        assert r["backward"]["reduce_scatter_tensor"] == n_params, r  # each gradient into its dp shard
        assert r["forward"]["all_gather_into_tensor"] >= n_params - 2, r  # weights gathered on dp where used
        # tp: one per block input gradient and one into the output projection; no gradient is all-reduced
        assert r["backward"]["all_reduce"] == 2 * config.n_layers + 1, r


@pytest.fixture(scope="module")
def llama_tp():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import llama_tp
        from models.llama import LlamaConfig

        yield llama_tp, LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("sequence_parallel, expected", [
    # after attention, after the FFN, and the vocab-parallel embedding. ~8 s, with --slow: tp+sp runs the example
    # (checkpoint, meta device, load_sharded), test_generate_on_two_gloo_ranks Megatron's all_reduces on 2 ranks
    pytest.param(False, ["all_reduce"] * 3, marks=pytest.mark.slow),
    (True, ["reduce_scatter_tensor", "all_gather_into_tensor"] * 3),
], ids=["tp", "tp+sp"])
def test_llama_on_two_gloo_ranks(llama_tp, sequence_parallel, expected):
    """As examples/llama_tp.py runs (with --tp-only too): the single-device run writes its checkpoint once
    (``setup``), each rank builds the model on the meta device and reads only its shards of it
    (fxshard.load_sharded); TP leaves the norm weights plain tensors, TP+SP makes them DTensors."""
    module, config = llama_tp
    results = module.spawn(world_size=2, timeout=900.0, sequence_parallel=sequence_parallel, config=config,
                           batch=2, seq=16, steps=1,
                           setup=lambda workdir: module.write_checkpoint(f"{workdir}/llama.pt", config))
    for rank, r in sorted(results.items()):
        assert r["error"] <= 1e-4, f"rank {rank}: max abs error {r['error']:.2e} vs the single-device Llama"
        assert sorted(r["collectives"]) == sorted(expected), f"rank {rank}: {r['collectives']}"


def test_data_parallel_training_with_a_short_last_batch_on_two_gloo_ranks():
    """A DataLoader without drop_last: batches of 4, 4 and 3 rows (the short one uneven over 2 ranks: 2 + 1),
    two epochs through torch.compile(backend="fxshard") with its default dynamic shapes, then inference with
    dynamic=True over sizes 4, 3, 4, 2, 3. Every step matches one device; programs are compiled per size.

    Dynamo guards a DTensor on its local shape only, so before the global shape was guarded rank 0 (2 rows
    of 4 and of 3) ran the program planned for 4 rows on a batch of 3, a wrong loss, while rank 1 recompiled.
    """
    results = run_program("data_parallel_epochs", 2, timeout=900.0, reads_shape=True)
    for rank, r in sorted(results.items()):
        assert r["sizes"] == [4, 4, 3] * 2
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, r["losses"], r["ref_losses"])
        assert r["param_error"] <= 1e-6, (rank, r["param_error"])
        # a program per size in each graph Dynamo makes: 4 rows (static graph), 3 rows (a new graph), and at
        # most once more for 4 rows where Dynamo's second graph has dynamic sizes; nothing after the first epoch
        assert 2 <= r["programs"] <= 3, (rank, r["programs"])
        assert r["inference_error"] <= 1e-5 and r["warned_dynamic"], (rank, r)
        assert 3 <= r["inference_programs"] <= 4, (rank, r["inference_programs"])  # sizes 4, 3, 2 (+1: see above)


def test_graph_breaks_on_two_gloo_ranks():
    """A model Dynamo splits three ways (an ``if`` on a tensor, ``.item()``) under torch.compile: both
    branches and a training step match one device, the activation crosses each break sharded as the
    graph before left it, and ``.item()`` reads the same max on every rank (it leaves its graph replicated)."""
    results = run_program("graph_breaks", 2, timeout=600.0)
    for rank, r in sorted(results.items()):
        assert r["forward_error"] <= 1e-5 and r["grad_error"] <= 1e-5, (rank, r)
        carried = [graph["h"] for graph in r["inputs"] if "h" in graph]
        assert len(carried) >= 4 and set(carried) == {"[4] [2@tp 8]"}, (rank, r["inputs"])


@pytest.fixture(scope="module")
def generate():
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import generate

        yield generate
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("cache, new_tokens, programs", [
    ("static", 3, 2),
    ("dynamic", 6, 3),
])
def test_generate_on_two_gloo_ranks(generate, cache, new_tokens, programs):
    """examples/generate.py: Hugging Face ``generate()`` (greedy, KV cache sharded on kv heads) of the
    compiled model gives the single-device tokens on every rank. A static cache compiles the prefill
    and one decode step. A dynamic one the prefill and decode steps for the first two lengths, whose programs
    differ only in the cache's length, unsharded: one program then serves the three later lengths
    (backend/programs/size_generic.py). Each decode step does Megatron's
    collectives: an all_reduce per attention and per MLP (2 layers), one for the vocab-parallel
    embedding, and the all_gather of the logits; the cache is never gathered."""
    results = generate.spawn(world_size=2, timeout=900.0, cache=cache, prompt=6, new_tokens=new_tokens, repeats=1,
                             inductor=False)
    for rank, r in sorted(results.items()):
        assert r["same_tokens"], f"rank {rank}: {r['tokens']}"
        assert r["programs"] == programs, f"rank {rank}: {r['programs']} programs"
        assert r["decode_collectives"] == {"all_reduce": 5, "all_gather_into_tensor": 1}, r["decode_collectives"]


def test_sequence_parallel_training_with_windows_on_two_gloo_ranks():
    """Two SwiGLU blocks under torchtitan's tensor + sequence parallel plan, trained through
    torch.compile(backend="fxshard") as whole programs: the backward's gather for the first block runs
    while the second block's weight gradients compute (backend/inductor/collective_windows.py; tests/test_overlap.py
    reads the same code on a fake group). Two SGD steps match one device on both ranks."""
    with examples_and_tests_on_path():
        from inductor_code import calls, collective_kinds
    results = run_program("sequence_parallel_blocks", 2, timeout=900.0)
    for rank, r in sorted(results.items()):
        assert r["loss_error"] <= 1e-5 and r["param_error"] <= 1e-5, (rank, r["loss_error"], r["param_error"])
        kinds = [sorted(collective_kinds(code)) for code in r["codes"]]
        assert kinds == [["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"],
                         ["all_gather", "all_gather", "all_reduce", "reduce_scatter", "reduce_scatter"]], (rank, kinds)
        backward = [c for c in calls(r["codes"][1]) if not c.startswith("cpp_fused")]
        second_gather = [i for i, c in enumerate(backward) if c == "_c10d_functional.all_gather_into_tensor"][1]
        window = backward[second_gather + 1:]
        assert window[:window.index("_c10d_functional.wait_tensor")] == ["mm"] * 3, (rank, backward)


@pytest.mark.slow
def test_regional_fsdp_with_uneven_shards_on_two_gloo_ranks():
    """The same uneven FSDP blocks, three of them, compiled regionally (backend/layers/regions.py): each rank
    compiles its block once and runs it for all three; the ranks' collectives agree (a mismatch would hang)
    and two SGD steps match one device."""
    results = run_program("fsdp_blocks", 2, timeout=900.0, regional=True, layers=3)
    for rank, r in sorted(results.items()):
        # the parameters after two steps differ by 4.6e-5 at most, the whole programs' too: three blocks'
        # float32 rounding (one step: 2.4e-7)
        assert r["loss_error"] <= 1e-5 and r["param_error"] <= 1e-4, (rank, r["loss_error"], r["param_error"])
        # a layer's program each way, the prologue's and the epilogue's: regions, not the two whole programs
        assert len(r["codes"]) > 2, (rank, len(r["codes"]))


@pytest.mark.slow
def test_bucketed_fsdp_with_uneven_shards_on_two_gloo_ranks():
    """FSDP blocks whose rows do not divide by 2 (15 and 31: shards of 8 and 7, 16 and 15), bucketed by
    block (backend/inductor/buckets.py): both ranks issue the same buckets (a mismatch would hang), and
    two SGD steps match one device. tests/test_overlap.py checks the same buckets without ranks."""
    with examples_and_tests_on_path():
        from inductor_code import collective_kinds
    results = run_program("fsdp_blocks", 2, timeout=900.0)
    for rank, r in sorted(results.items()):
        assert r["loss_error"] <= 1e-5 and r["param_error"] <= 1e-5, (rank, r["loss_error"], r["param_error"])
        kinds = [sorted(collective_kinds(code)) for code in r["codes"]]
        # a bucket per block forward (and the loss); backward, each block's regathered weight and a bucket
        # of its gradients
        assert kinds == [["all_gather"] * 2 + ["all_reduce"], ["all_gather"] * 2 + ["reduce_scatter"] * 2], (rank, kinds)


def test_dropless_moe_trains_with_experts_dispatched_on_four_gloo_ranks():
    """A dropless MoE layer (tests/moe_programs.py) with its experts Shard(0) on ep=4 and skewed routing: two SGD
    steps through torch.compile equal one device's: the loss, and each parameter's update (what its gradients
    moved it by: one lost is an error of 1) within bf16's rounding; the compiled programs ran the routed op
    (rows dispatched by all_to_all, never the experts gathered: tests/test_moe_dispatch.py counts what
    moves), its experts compiled by Inductor inside it. ~30 s."""
    with examples_and_tests_on_path():
        import moe_programs
        from ranks import spawn

        results = spawn(moe_programs.sgd_steps, 4, timeout=600.0, steps=2)
    for rank, result in results.items():
        assert result["loss_error"] < 1e-3, (rank, result)
        assert result["update_error"] < 5e-2, (rank, result)
        assert {"plan_forward", "plan_backward"} <= set(result["routed"]), (rank, result)
        # Dynamo's graphs: the model's, and the routed op's forward and backward, each compiled once for
        # both steps' routings (its split sizes unbacked)
        assert result["graphs"]["unique_graphs"] == 3, (rank, result)


def test_context_parallel_training_on_two_gloo_ranks():
    """Two Llama-style blocks with the input Shard(1) on cp=2 (tests/cp_programs.py): two SGD steps through
    torch.compile equal one device's (loss and every parameter's update); the compiled programs ran fxshard's
    causal-rows attention forward and backward (each rank its rows over the keys before them)."""
    with examples_and_tests_on_path():
        import cp_programs
        from ranks import spawn

        results = spawn(cp_programs.sgd_steps, 2, timeout=600.0, steps=2)
    for rank, result in results.items():
        assert result["loss_error"] < 1e-4, (rank, result)
        assert result["update_error"] < 1e-3, (rank, result)
        assert result["stages"], (rank, result)


def test_context_parallel_flex_attention_under_inductor_on_two_gloo_ranks():
    """FlexAttention with a causal block mask, the sequence Shard(1) on cp=2, through fxshard.compile with
    Inductor's C++ flex kernel: each rank's query blocks of the block mask are slices, which that kernel read
    from their buffer's start (rank 1 got rank 0's blocks: an error of 0.47) until
    backend/inductor/flex_inputs.py copied them; now one device's result."""
    with examples_and_tests_on_path():
        import cp_programs
        from ranks import spawn

        results = spawn(cp_programs.flex_forward, 2, timeout=600.0)
    for rank, result in results.items():
        assert result["error"] < 1e-5, (rank, result)


def test_data_parallel_moe_routes_each_ranks_tokens_on_two_gloo_ranks():
    """The dropless MoE layer with its experts replicated and the tokens Shard(0) (data parallel): the routed op
    without dispatch, each rank its own tokens through every expert (tests/test_moe_dispatch.py: nothing moves in
    the forward); two SGD steps through torch.compile equal one device's."""
    with examples_and_tests_on_path():
        import moe_programs
        from ranks import spawn

        results = spawn(moe_programs.sgd_steps, 2, timeout=600.0, steps=2, experts_sharded=False)
    for rank, result in results.items():
        assert result["loss_error"] < 1e-3, (rank, result)
        assert result["update_error"] < 5e-2, (rank, result)
        assert {"plan_forward", "plan_backward"} <= set(result["routed"]), (rank, result)
