"""What the backward of an elementwise op keeps, by operator name (torch's ``derivatives.yaml``).

The cost model's activation memory (``cost_models/activations.py``) reads these tables to list
autograd's saved tensors of a captured graph. The names are torch's (ATen) spellings: a target
``aten.<name>.<overload>`` is matched by ``<name>`` and, where an overload differs, by
``<name>.<overload>``; other targets (ONNX's ``Mul``, a synthetic graph's ``dropout``) by their
first dotted part as written.
"""

from __future__ import annotations

from ._pointwise import DROPOUT_TARGETS

# what an elementwise op's backward keeps: nothing, its output, or (the default: gelu, silu, mul,
# div, pow, sin, ...) its input (masked_fill's backward zeroes the gradient where the mask is set: it
# keeps the boolean mask only)
SAVES_NOTHING = frozenset({"add", "sub", "rsub", "neg", "to", "_to_copy", "clone", "contiguous", "alias", "type_as",
                           "mul.Scalar", "div.Scalar", "add.Scalar", "sub.Scalar", "masked_fill"})
SAVES_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "reciprocal"})

# ops whose outputs carry no gradient: comparisons, logical and bitwise ops, tests, sign
NO_GRAD = frozenset({"eq", "ne", "le", "lt", "ge", "gt", "__and__", "__or__", "__xor__", "logical_and", "logical_or",
                     "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "sign"})

# binary ops whose backward keeps each operand, for the gradient of the other
SAVES_OPERANDS = frozenset({"mul", "div", "where", "maximum", "minimum", "pow", "atan2"})


def aten_name(target: str) -> str:
    """The operator name these tables match: ``aten.mul.Tensor`` -> ``mul``; any other target's
    first dotted part, case kept (ONNX's ``Mul`` is not described here)."""
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]


def backward_saves(target: str) -> str:
    """``nothing``, ``output``, ``input`` or ``mask``: what the backward of the elementwise op
    ``target`` keeps (a dropout its boolean mask, one byte per element: torch's ``native_dropout``,
    Megatron's uint8 mask)."""
    parts = target.split(".")
    base = aten_name(target)
    overload = f"{base}.{parts[2]}" if parts[0] == "aten" and len(parts) > 2 else base
    if base in SAVES_NOTHING or overload in SAVES_NOTHING:
        return "nothing"
    if base in DROPOUT_TARGETS:
        return "mask"
    return "output" if base in SAVES_OUTPUT else "input"
