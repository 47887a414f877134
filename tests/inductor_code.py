"""What a program Inductor generated calls, read from its Python wrapper or its C++ one alike.

fxshard compiles CPU programs with Inductor's C++ wrapper (backend/inductor/cpu_wrapper.py); ``FXSHARD_CPU_WRAPPER=0``
or a GPU gives the Python wrapper. Both call the same things in the same order, spelled differently:

- an operator: ``torch.ops._c10d_functional.wait_tensor.default(...)`` in Python; in C++ a shim,
  ``aoti_torch_cpu__c10d_functional_wait_tensor(...)``, or a call back into Python naming it,
  ``PyUnicode_FromString("torch.ops.fxshard.unpack_gathered.default")``;
- a library kernel: ``extern_kernels.mm(...)``, ``aoti_torch_cpu_mm_out(...)``;
- a generated kernel: ``cpp_fused_0(...)`` in both.
"""
from __future__ import annotations

import re

from fxshard.lowering.collective_ops import COLLECTIVES

__all__ = ["calls", "collective_kinds", "is_cpp", "kernels"]

_PYTHON = re.compile(r"torch\.ops\.([\w.]+?)\.default\(|extern_kernels\.(\w+)\(|\b(cpp_fused_\w+)\(")
_CPP = re.compile(r'PyUnicode_FromString\("torch\.ops\.([\w.]+?)\.default"\)|aoti_torch_cpu_(\w+?)(?:_out)?\('
                  r'|\b(cpp_fused_\w+)\(')
# a shim's name is the operator's with its namespace's dot an underscore
_SHIM_NAMESPACES = ("_c10d_functional",)
_COLLECTIVES = {name: c.kind for name, c in COLLECTIVES.items()  # a subset: the kinds stage 6 buckets
                if c.kind in ("all_gather", "reduce_scatter", "all_reduce")}


def is_cpp(code: str) -> bool:
    return "inductor_entry_impl" in code


def calls(code: str) -> list[str]:
    """The operators and kernels the program's entry calls, in order: ``_c10d_functional.wait_tensor``,
    ``mm``, ``cpp_fused_0``."""
    if is_cpp(code):
        body = code[code.index("void inductor_entry_impl("):code.index("} // inductor_entry_impl")]
        found = []
        for op, shim, kernel in _CPP.findall(body):
            if shim:
                namespace = next((n for n in _SHIM_NAMESPACES if shim.startswith(f"{n}_")), None)
                shim = f"{namespace}.{shim[len(namespace) + 1:]}" if namespace else shim
            found.append(op or shim or kernel)
        return found
    body = code[code.index("def call(self, args):"):]
    return [op or extern or kernel for op, extern, kernel in _PYTHON.findall(body)]


def collective_kinds(code: str) -> list[str]:
    """The collectives the program starts, in order: ``all_gather``, ``reduce_scatter``, ``all_reduce``."""
    return [_COLLECTIVES[name.split(".")[-1]] for name in calls(code)
            if name.startswith("_c10d_functional.") and name.split(".")[-1] in _COLLECTIVES]


def kernels(code: str) -> list[str]:
    """The C++ kernels Inductor generated for the program, each once."""
    if is_cpp(code):
        return list(dict.fromkeys(re.findall(r'extern "C"\s+void\s+(cpp_fused_\w+)\(', code)))
    return re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.M)
