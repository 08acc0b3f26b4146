"""A module's call as :func:`fusedkit.fuse` traces it, and as its fused forward knows it again.

fusedkit traces a module from its first call in the example run, as the model made it:
transformers calls ``LlamaDecoderLayer(h, attention_mask=None, position_ids=p,
cache=DynamicCache, use_cache=True, position_embeddings=(cos, sin))``. Of that call

- tensors, in tuples, lists and dicts with string keys too, are the traced forward's inputs;
- None, numbers, strings, dtypes and devices are fixed as the call gave them (``use_cache``
  takes its branch, ``attention_mask is None`` its own);
- any other object (the KV cache) is an input too, one the traced code may only hand on to a
  submodule it keeps whole (the attention, which updates the cache), checked after the trace.

:meth:`CallSpec.inputs` tells a later call of the same shape (the same positions and
keywords, tensors where tensors were, objects of the same classes, the same fixed values)
from any other, which runs the module's own forward: generated Python, a few type checks
per argument and no tree walk, since a decoding step calls every layer once a token.
"""

from __future__ import annotations

import inspect
import keyword
import math
import re

import torch

__all__ = ["CallSpec", "FIXED_TYPES"]

#: What a call may fix in the trace: the values a branch reads (compared on every call).
FIXED_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _Slot:
    """Where an input goes back into the call: the ``index``-th traced input."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class CallSpec:
    """One call's shape: ``names`` of the traced inputs (placeholders), ``classes`` (for each
    input, ``torch.Tensor`` or the object's class), ``example`` (the call's own inputs), and
    :meth:`rebuild` / :meth:`inputs` between the inputs and ``(args, kwargs)``."""

    def __init__(self, args: tuple, kwargs: dict, params: list | None = None):
        self.names: list[str] = []
        self.classes: list[type] = []
        self.example: list = []
        self._fixed: list = []
        self._lines = [
            f"if type(args) is not tuple or len(args) != {len(args)} or len(kwargs) != {len(kwargs)}:",
            "    return None",
        ]
        self._returned: list[str] = []
        positional = [p.name for p in params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        slots = tuple(
            self._visit(v, f"args[{i}]", positional[i] if i < len(positional) else f"arg{i}")
            for i, v in enumerate(args)
        )
        kw = {}
        for key, value in kwargs.items():
            self._lines += [f"if {key!r} not in kwargs:", "    return None"]
            kw[key] = self._visit(value, f"kwargs[{key!r}]", key)
        self._template = (slots, kw)
        body = "".join(f"    {line}\n" for line in self._lines)
        self.source = f"def inputs(args, kwargs):\n{body}    return ({''.join(v + ', ' for v in self._returned)})\n"
        scope = {"Tensor": torch.Tensor, "fixed": self._fixed, "classes": self.classes, "copysign": math.copysign}
        exec(compile(self.source, "<fusedkit call spec>", "exec"), scope)
        #: ``(args, kwargs) -> tuple | None``: a call's traced inputs, or None for a call of
        #: another shape.
        self.inputs = scope["inputs"]
        del self._lines

    def _visit(self, value, expr: str, name: str):
        """The template of ``value`` (found at ``expr`` in the call), its checks appended."""
        var = f"v{len(self._lines)}"
        self._lines.append(f"{var} = {expr}")
        check = self._lines.extend
        container = type(value) in (tuple, list) or (type(value) is dict and all(type(k) is str for k in value))
        if isinstance(value, torch.Tensor) or not (container or type(value) in FIXED_TYPES):
            if isinstance(value, torch.Tensor):
                check([f"if not isinstance({var}, Tensor):", "    return None"])
            else:  # an object: one of its class
                check([f"if type({var}) is not classes[{len(self.classes)}]:", "    return None"])
            self.classes.append(torch.Tensor if isinstance(value, torch.Tensor) else type(value))
            self.example.append(value)
            self.names.append(self._placeholder(name))
            self._returned.append(var)
            return _Slot(len(self.names) - 1)
        if type(value) in (tuple, list):
            check([f"if type({var}) is not {type(value).__name__} or len({var}) != {len(value)}:", "    return None"])
            return type(value)(self._visit(v, f"{var}[{i}]", f"{name}_{i}") for i, v in enumerate(value))
        if type(value) is dict:
            check([f"if type({var}) is not dict or len({var}) != {len(value)}:", "    return None"])
            items = {}
            for k, v in value.items():
                check([f"if {k!r} not in {var}:", "    return None"])
                items[k] = self._visit(v, f"{var}[{k!r}]", f"{name}_{k}")
            return items
        if value is None:
            check([f"if {var} is not None:", "    return None"])
        else:
            self._fixed.append(value)
            ref = f"fixed[{len(self._fixed) - 1}]"
            check([f"if type({var}) is not type({ref}) or {var} != {ref}:", "    return None"])
            if type(value) is float:  # (-0.0 == 0.0: the sign too)
                check([f"if copysign(1.0, {var}) != copysign(1.0, {ref}):", "    return None"])
        return value

    def _placeholder(self, name: str) -> str:
        name = re.sub(r"\W", "_", name)
        if not name or name[0].isdigit() or keyword.iskeyword(name) or name == "self":
            name = f"input_{name}"
        candidate, n = name, 1
        while candidate in self.names:
            candidate, n = f"{name}_{n}", n + 1
        return candidate

    def rebuild(self, inputs) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the call with ``inputs`` (traced proxies, or values) in place."""

        def fill(t):
            if isinstance(t, _Slot):
                return inputs[t.index]
            if type(t) in (tuple, list):
                return type(t)(fill(v) for v in t)
            if type(t) is dict:
                return {k: fill(v) for k, v in t.items()}
            return t

        args, kwargs = self._template
        return fill(args), fill(kwargs)

    @classmethod
    def of(cls, model, args: tuple, kwargs: dict) -> CallSpec:
        """The spec of ``model(*args, **kwargs)`` (a module: its forward's names for positions)."""
        try:
            params = list(inspect.signature(type(model).forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = None
        return cls(args, kwargs, params)
