"""Loop-nest builders, one module per op family; both frontends build ops through these.

Each builder takes operand shapes and attributes and returns a
:class:`~polyparallel.ir.LoopNest` whose operands are ``in0..`` in the argument order
documented on the builder, or raises :class:`NotModelled` when the op with these
shapes has no affine description (the frontend then keeps it as an opaque op).
"""

from ._attention import attention
from ._autograd import NO_GRAD, SAVES_NOTHING, SAVES_OPERANDS, SAVES_OUTPUT, aten_name, backward_saves
from ._common import NotModelled, broadcast_shapes
from ._contraction import einsum, linear, matmul
from ._conv import adaptive_pool, conv, conv_transpose, out_extent, pool
from ._gather import advanced_index, cross_entropy, embedding, gather, nll_loss, take_along_axis
from ._moe import grouped_mm
from ._norm import batch_norm, group_norm, layer_norm, softmax
from ._pointwise import (
    CAST_TARGETS,
    COPY_TARGETS,
    DROPOUT_TARGETS,
    FLOPS_PER_ELEMENT,
    create,
    elementwise,
    flops_per_element,
    reduce,
    scan,
)
from ._rnn import onnx_recurrent, torch_recurrent, torch_recurrent_cell
from ._view import (
    concat,
    expand,
    pad,
    permute,
    reshape,
    select,
    slice_,
    split,
    stack,
    transpose,
    upsample_linear,
    upsample_nearest,
)

__all__ = [
    "CAST_TARGETS",
    "COPY_TARGETS",
    "DROPOUT_TARGETS",
    "FLOPS_PER_ELEMENT",
    "NO_GRAD",
    "SAVES_NOTHING",
    "SAVES_OPERANDS",
    "SAVES_OUTPUT",
    "NotModelled",
    "adaptive_pool",
    "advanced_index",
    "aten_name",
    "attention",
    "backward_saves",
    "batch_norm",
    "broadcast_shapes",
    "concat",
    "conv",
    "conv_transpose",
    "create",
    "cross_entropy",
    "einsum",
    "elementwise",
    "embedding",
    "expand",
    "flops_per_element",
    "gather",
    "group_norm",
    "grouped_mm",
    "layer_norm",
    "linear",
    "matmul",
    "nll_loss",
    "onnx_recurrent",
    "out_extent",
    "pad",
    "permute",
    "pool",
    "reduce",
    "reshape",
    "scan",
    "select",
    "slice_",
    "softmax",
    "split",
    "stack",
    "take_along_axis",
    "torch_recurrent",
    "torch_recurrent_cell",
    "transpose",
    "upsample_linear",
    "upsample_nearest",
]
