"""Eager launches in C++ (``csrc/eager.cpp``): opt-in, ``fusedkit.settings.set(native_launch=True)``
(or ``FUSEDKIT_NATIVE_LAUNCH=1``).

From Python a small call's floor is one allocation plus Triton's C launch function,
already more than ``torch.add``'s whole call on the H200 host (``docs/why-fusion.md``).
With the variable set, the first kept elementwise launch builds a small PyTorch C++
extension (a C++ compiler and ninja are needed; a failed build warns once and leaves
the Python fast path in charge) holding a table of kept launches. A repeated call then
matches its signature, allocates its result and launches the kernel in C++; whatever
the table does not match (other types, grad, misaligned pointers, a launch hook, a
different device) returns None and takes the Python path, which is unchanged.

The table holds only launches whose kernel Triton compiled for 16-byte-aligned
pointers, with every operand a tensor on the launch's device, on Triton 3.6 (whose
launcher's parameter packing it repeats: the kernel's non-constant arguments, then two
scratch pointers), one CTA per program and no cooperative or PDL launch.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

from .. import settings

__all__ = ["TABLE", "enabled", "clear", "register"]

_SOURCE = Path(__file__).with_name("csrc") / "eager.cpp"
#: The process's launch table once built (None: off, not needed yet, or unavailable).
TABLE = None
_BUILD_FAILED = False
#: Argument roles of the elementwise kernel's pointer parameters, by name.
_OPERAND_POINTERS = ("a_ptr", "b_ptr", "c_ptr")


def enabled() -> bool:
    """Whether kept launches go into the C++ table too (``fusedkit.settings``' ``native_launch``;
    read when a launch is kept)."""
    return settings.current().native_launch


def build(dry_run: bool = False):
    """Compile (or load the cached build of) the extension; return a new table (a dry-run
    table records the parameters it would launch with instead of launching: for tests)."""
    from torch.utils.cpp_extension import load

    module = load("fusedkit_eager", sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    return module.Table(dry_run)


def _table():
    global TABLE, _BUILD_FAILED
    if TABLE is None and not _BUILD_FAILED:
        try:
            TABLE = build()
        except Exception as exc:  # no compiler, no ninja, headers missing: stay in Python
            _BUILD_FAILED = True
            warnings.warn(f"fusedkit: native launches are off, the extension did not build: {exc}", stacklevel=3)
    return TABLE


def clear() -> None:
    """Forget every kept native launch (with the kept launches they came from)."""
    if TABLE is not None:
        TABLE.clear()


def _param_encoding(param) -> tuple[int, int] | None:
    """(kind, bits) of the Python number the kernel's parameter was encoded from."""
    if param is None:
        return 0, 0
    if type(param) is int:
        return 1, param
    if type(param) is float:
        return 2, struct.unpack("<q", struct.pack("<d", param))[0]
    return None  # other number types: the Python path


def launch_layout(kept, entry) -> tuple[str, list[int]] | None:
    """The table's ``kinds`` and ``values`` for the kernel parameters of a kept launch of
    ``kept``, in the order Triton 3.6 passes them (compile-time constants dropped)."""
    bits, _ = kept.last_param[1]
    values = (0, 0, 0, 0, *bits, *kept.launch_tail)  # the kernel's signature order
    signature = entry.compiled.src.signature
    if len(signature) != len(values):
        return None
    slots = dict(zip(_OPERAND_POINTERS, kept.tensor_slots))
    kinds, kept = [], []
    for (name, ty), value in zip(signature.items(), values):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            slot = slots.get(name)
            kinds.append("o" if slot is None else str(slot))
            kept.append(0)
        elif ty in ("i32", "i64"):
            kinds.append("i" if ty == "i32" else "l")
            kept.append(int(value))
        else:
            return None  # a parameter type this table does not pack
    return "".join(kinds), kept


def register(kept, entry, table=None) -> bool:
    """Add ``entry`` (a kept launch of ``kept``, compiled for aligned pointers) to the
    table; False when it does not qualify or the table is unavailable."""
    if not enabled() or kept.operand_signature is None or not entry.head:
        return False
    cooperative, pdl = entry.head[:2]
    num_warps, num_ctas, shared = entry.packed_metadata
    param = _param_encoding(kept.last_param[0])
    layout = launch_layout(kept, entry) if kept.last_param[1] is not None else None
    if cooperative or pdl or num_ctas != 1 or param is None or layout is None:
        return False
    table = table if table is not None else _table()
    if table is None:
        return False
    operands = [(dtype, list(shape), list(strides)) for dtype, shape, strides in kept.operand_signature]
    kinds, values = layout
    table.add(id(kept.kernel), kept.device, operands, *param, list(kept.shape), list(kept.out_strides),
              kept.dtype, entry.function, entry.grid[0], 32 * num_warps, shared, kinds, values)
    return True
