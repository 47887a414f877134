"""Inductor's C++ wrapper for programs on the CPU: two runs of the C++ compiler per program, not one per kernel.

With its default (Python) wrapper, Inductor compiles each C++ kernel of a CPU program with its own run of
the compiler, ~1 s each on this project's machine, nearly all of it fixed cost (a Llama layer's forward and
backward: 13 kernels, 13 runs, ~15 of a 23 s first step). With its C++ wrapper (``cpp_wrapper``) the
kernels and the code that calls them are one program, built separately (``cpp_wrapper_build_separate``): the
calling code at -O0 (``CALLS_OPT_LEVEL``) and the kernels at -O3, each on its precompiled header, then
linked. Built as one source the kernels' header was compiled with every program (a step's forward 4.0 s, backward 5.0 s); built
separately a program costs ~2.2 s and ~0.1 s a kernel (``python bench/compile.py`` measures the first step,
bench/results/compile.md, sessions 30-31). At every step the program's calls are then made from C++ (those it
makes through Python excepted, below).

torch 2.13's C++ wrapper does not take fxshard's programs as they are; for fxshard's compiles only (the
code generator is swapped while ``compile_local`` compiles, ``cpu_wrapper_mended``) three things are mended,
each where the installed torch's wrapper needs it (``needed_mends`` probes torch's own code; torch 2.15
fixed the first two, and its wrapper's own code is then what runs):

- ``GROUP_NAMES``: the functional collectives' process group argument is typed ``Any`` in their schemas, and
  the wrapper raises ``NotImplementedError`` for an ``Any`` argument it calls through Python: a group named by
  a string is handed over as a string;
- ``RETURNED_HANDLE``: a call that writes into a buffer and returns it (``all_gather_into_tensor_out``: a
  bucketed gather) had the one handle it returns read as a list of two, one per buffer Inductor lists it
  writing (the written buffer twice where the gather is in place; the bucket's input and its own buffer
  where it is not, as for a region's gathered parameters that later regions read): a read past the end, a
  crash or worse. The buffer the return aliases (``out``) takes the one handle back;
- ``THROUGH_PYTHON`` (every torch: a cost, not a bug): an op the wrapper would call through the C++ dispatcher
  (a ``Tensor[]`` argument: the pack of a bucketed reduce_scatter) pulls the dispatcher's headers into the
  program, ~6.5 s more of the compiler per program; it is called through Python instead (one call back into
  Python per step, as the Python wrapper calls every op).

``use_cpu_wrapper`` says where it applies: every input on the CPU (on a GPU the kernels are Triton's and the
Python wrapper compiles nothing), static sizes, about ``Options.min_kernels`` kernels or more (``expected_kernels``;
a program of one or two compiles as fast with the Python wrapper), a torch whose wrapper has what the mends
replace, and ``FXSHARD_CPU_WRAPPER`` not ``0``. A program the C++ wrapper still cannot compile is compiled with the
Python wrapper (``compile_local``), with a warning naming the error.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx

from fxshard.backend.options import in_force
from fxshard.routing import ROUTED_OPS

__all__ = ["CALLS_OPT_LEVEL", "GROUP_NAMES", "MENDS", "RETURNED_HANDLE", "THROUGH_PYTHON",
           "cpu_wrapper_mended", "cpu_wrapper_patches", "expected_kernels", "generated_op", "needed_mends",
           "use_cpu_wrapper"]

aten = torch.ops.aten
# Calls Inductor hands to a library (or falls back on) rather than generating code for
_LIBRARY = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution,
                      aten._scaled_dot_product_flash_attention_for_cpu,
                      aten._scaled_dot_product_flash_attention_for_cpu_backward,
                      aten._scaled_dot_product_efficient_attention,
                      aten._scaled_dot_product_efficient_attention_backward, aten.split_with_sizes_copy})
_VIEWS = frozenset({aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.t, aten.transpose, aten.expand,
                    aten.slice, aten.select, aten.squeeze, aten.unsqueeze, aten.alias, aten.detach, aten.as_strided,
                    aten.split, aten.split_with_sizes, aten.unbind, aten.view_as_real, aten.view_as_complex})

# The calling code's optimization level (torch's default -O1): it only calls kernels, libraries and Python, and
# -O0 compiles it 0.1-0.4 s faster a program (0.60-0.70 s against 0.66-1.12, bench/compile.py's FSDP
# regions, 2026-11-29) for steps as fast (paired one-process steps O0 / O1, 4-layer Llama: FSDP 0.998, TP
# 1.008 and 0.986, FSDP x TP 1.016)
CALLS_OPT_LEVEL = "O0"
# the mends (the module docstring), each named by the method of torch's C++ wrapper it overrides, whose
# signature torch 2.13 and 2.15 give alike
GROUP_NAMES = "generate_py_arg"
RETURNED_HANDLE = "generate_fallback_kernel_with_runtime_lookup_python"
THROUGH_PYTHON = "_compatible_with_cpp_boxed_dispatch"
MENDS = (GROUP_NAMES, RETURNED_HANDLE, THROUGH_PYTHON)


def use_cpu_wrapper(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether ``compile_local`` compiles this program with the C++ wrapper (the module docstring)."""
    if not in_force().cpu_wrapper or _mended_class() is None:
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    static = all(isinstance(n, int) for x in tensors for n in (*x.shape, *x.stride()))  # symbolic: not taken
    cpu = bool(tensors) and all(x.device.type == "cpu" for x in tensors)
    return cpu and static and not _python_op_returning_a_list(gm) and expected_kernels(gm) >= in_force().min_kernels


def _python_op_returning_a_list(gm: fx.GraphModule) -> bool:
    """A call of a routed-experts op (fxshard/routing.py): a Python op returning a list of tensors as many as its
    body's outputs, which torch's C++ wrapper reads as one tensor handle (a crash), so such a program keeps
    the Python wrapper. (fxshard's ``unpack_gathered`` returns a list too, which the mends make it read.)"""
    return any(node.op == "call_function" and node.target in ROUTED_OPS for node in gm.graph.nodes)


def cpu_wrapper_patches() -> dict[str, Any]:
    """Inductor's config for a C++-wrapped CPU program: the wrapper, its calling code and kernels compiled
    separately (each on a precompiled header) where this torch can."""
    patches: dict[str, Any] = {"cpp_wrapper": True}
    if hasattr(torch._inductor.config, "cpp_wrapper_build_separate"):
        patches["cpp_wrapper_build_separate"] = True
        if hasattr(torch._inductor.config.aot_inductor, "compile_wrapper_opt_level"):
            patches["aot_inductor.compile_wrapper_opt_level"] = CALLS_OPT_LEVEL
    return patches


def expected_kernels(gm: fx.GraphModule) -> int:
    """About how many kernels Inductor generates for ``gm``: the runs of its own ops (not views) between
    calls of library kernels or collectives, which its fusion does not cross (a Llama layer's forward: 5,
    as Inductor makes; its backward: 8)."""
    runs, in_run = 0, False
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if _is_library_call(node.target):
            in_run = False
        elif generated_op(node.target) and not in_run:
            runs, in_run = runs + 1, True
    return runs


def generated_op(target: Any) -> bool:
    """Whether Inductor generates code for a call of ``target``: an aten op, neither a library kernel's (a
    matmul, attention, a collective) nor a view."""
    return (isinstance(target, torch._ops.OpOverload) and not _is_library_call(target)
            and target.overloadpacket not in _VIEWS)


def _is_library_call(op: torch._ops.OpOverload) -> bool:
    return op.namespace != "aten" or op.overloadpacket in _LIBRARY



@contextlib.contextmanager
def cpu_wrapper_mended() -> Iterator[None]:
    """Inductor's CPU code generation with the mended C++ wrapper (the module docstring) while inside."""
    from torch._inductor.codegen import common

    common.init_backend_registration()
    original, original_pass = common.device_codegens["cpu"], common.custom_backend_passes.get("cpu")
    common.device_codegens["cpu"] = common.DeviceCodegen(
        original.scheduling, original.wrapper_codegen, _mended_class(), original.fx_wrapper_codegen)
    common.custom_backend_passes["cpu"] = _marker(original_pass)
    try:
        yield
    finally:
        common.device_codegens["cpu"] = original
        common.custom_backend_passes["cpu"] = original_pass


def _marker(original: Any) -> Any:
    """A CPU pass that changes nothing but Inductor's FX graph cache key: what the mended wrapper generated
    is never served to another code generator, nor another code generator's to it (the key holds this
    file's hash). It runs the pass it stands in for, if any."""
    from torch._inductor.custom_graph_pass import CustomGraphModulePass, get_hash_for_files

    class MendedWrapperMarker(CustomGraphModulePass):
        def __call__(self, gm: torch.fx.GraphModule) -> None:
            if original is not None:
                original(gm)

        def uuid(self) -> Any:
            theirs = original.uuid() if original is not None and hasattr(original, "uuid") else None
            return (get_hash_for_files((__file__,)).hex(), theirs)

    return MendedWrapperMarker()


@functools.cache
def _mended_class() -> type | None:
    """The C++ wrapper's code generator with the mends; None where this torch's lacks what they replace."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return None
    if not all(hasattr(CppWrapperCpu, name) for name in MENDS):
        return None

    class MendedCppWrapperCpu(CppWrapperCpu):
        @staticmethod
        def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
                   partition_signatures: Any = None) -> "MendedCppWrapperCpu":
            return MendedCppWrapperCpu()

        def generate_py_arg(self, py_args_var: str, idx: int, raw_arg: Any, arg_type: Any) -> str:
            if isinstance(arg_type, torch.AnyType) and isinstance(raw_arg, str):  # a process group's name
                arg_type = torch.StringType.get()
            return super().generate_py_arg(py_args_var, idx, raw_arg, arg_type)

        @staticmethod
        def _compatible_with_cpp_boxed_dispatch(op: torch._ops.OpOverload) -> bool:
            return False  # through Python: the dispatcher's headers cost more to compile than the call costs

        def generate_fallback_kernel_with_runtime_lookup_python(self, buf_name: str, python_kernel_name: str,
                                                                op_overload: Any, raw_args: Any,
                                                                output_args: Any, raw_outputs: Any) -> None:
            returns = op_overload._schema.returns
            if len(returns) == 1 and isinstance(returns[0].real_type, torch.TensorType) and len(output_args) > 1:
                output_args, raw_outputs = _returned_buffer(op_overload, raw_args, output_args, raw_outputs)
            super().generate_fallback_kernel_with_runtime_lookup_python(
                buf_name, python_kernel_name, op_overload, raw_args, output_args, raw_outputs)

    for fixed in set(MENDS) - needed_mends():
        delattr(MendedCppWrapperCpu, fixed)  # torch's own method: this torch's wrapper has no such bug
    return MendedCppWrapperCpu


@functools.cache
def needed_mends() -> frozenset[str]:
    """The mends this torch's C++ wrapper needs, decided here only: each bug is probed in torch's own code. A
    probe that cannot run says mend: a mend where its bug is fixed generates what torch's code does (2.15)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    fixed = {GROUP_NAMES: _passes_strings_typed_any(CppWrapperCpu),
             RETURNED_HANDLE: _reads_a_returned_tensor_as_one_handle(CppWrapperCpu),
             THROUGH_PYTHON: False}  # not a bug: torch's choice of the dispatcher, which costs us compile time
    return frozenset(mend for mend in MENDS if not fixed[mend])


def _passes_strings_typed_any(wrapper: type) -> bool:
    """Whether ``wrapper`` passes a string argument typed ``Any`` (a collective's group name) to Python: torch
    2.15 does (pytorch/pytorch#188124, "[cpp_wrapper] Support fallback ops with Any args"); 2.13 raises."""
    try:
        code = wrapper.generate_py_arg(_bare(wrapper), "py_args", 1, "group", torch.AnyType.get())
    except Exception:  # noqa: BLE001 - NotImplementedError on torch 2.13; anything else: mended all the same
        return False
    return 'PyUnicode_FromString("group")' in code


def _reads_a_returned_tensor_as_one_handle(wrapper: type) -> bool:
    """Whether ``wrapper`` reads the one tensor an in-place ``all_gather_into_tensor_out`` returns as one
    handle (or not at all), not as a list of one per buffer the call writes: torch 2.15 reads none for
    buffers the call only writes (pytorch/pytorch#187331, "Fix cpp wrapper fallback outputs ...")."""
    from torch._inductor import ir

    probe = _bare(wrapper)
    written: list[Any] = []
    probe.custom_op_wrapper_loaded, probe.arg_var_id, probe.writelines = True, itertools.count(), written.extend
    written_twice = [ir.MutationOutput.__new__(ir.MutationOutput)] * 2  # the gather's buffer, in place
    try:
        wrapper.generate_fallback_kernel_with_runtime_lookup_python(
            probe, "buf1", "gather", torch.ops._c10d_functional.all_gather_into_tensor_out.default, (),
            ["buf0", "buf0"], written_twice)
    except Exception:  # noqa: BLE001 - a torch whose code this probe cannot run: mended
        return False
    return not any("PyList_GET_ITEM" in str(line) for line in written)


def _bare(wrapper: type) -> Any:
    """An instance of ``wrapper`` for a probe: not initialised, as its ``__init__`` needs a graph being compiled."""
    return wrapper.__new__(wrapper)


def _returned_buffer(op: torch._ops.OpOverload, raw_args: Sequence[Any], output_args: Sequence[str | None],
                     raw_outputs: Any) -> tuple[list[str], list[Any]]:
    """The one output, and its raw output, of a call returning one tensor that Inductor lists several outputs
    for (the buffers it writes: ``all_gather_into_tensor_out``'s ``out``, and its input where that is a slice
    of another buffer): the buffer of the argument its return aliases. Read as a list, the one handle the
    call returns made a read past its end. Raises ``NotImplementedError`` (``compile_local`` then takes the
    Python wrapper) where no such buffer is among the outputs."""
    named = [a for a in output_args if a is not None]
    if len(set(named)) == 1:
        kept: str | None = named[0]
    else:
        returned = op._schema.returns[0].alias_info
        aliased = [raw.get_name() for arg, raw in zip(op._schema.arguments, raw_args)
                   if returned is not None and arg.alias_info is not None and hasattr(raw, "get_name")
                   and arg.alias_info.before_set & returned.before_set]
        kept = aliased[0] if len(aliased) == 1 and aliased[0] in named else None
    if kept is None:
        raise NotImplementedError(f"{op}: which of the buffers {named} its one returned tensor is")
    outputs = list(raw_outputs or ())
    return [kept], outputs[list(output_args).index(kept):][:1]
