"""Handlers of normalisations and softmax: statistics reduced over some axes, then a per-element
normalisation (layer and RMS, batch and instance, group normalisation; softmax and log-softmax).
"""

from __future__ import annotations

from polyparallel import ops
from polyparallel.ir import OpKind

from ._registry import Call, Spec, _ints, handles


@handles("layer_norm", "native_layer_norm", "rms_norm")
def _layer_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    ins = [x] + [t for t in (w, b) if t]
    rms = c.name == "rms_norm"
    return OpKind.NORM, ins, lambda: ops.layer_norm(c.shape(x), _ints(c.get("normalized_shape")),
                                                    weight=w is not None, bias=b is not None, rms=rms)


@handles("batch_norm", "native_batch_norm", "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "instance_norm")
def _batch_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    rm, rv = c.tensor("running_mean"), c.tensor("running_var")
    training = bool(c.get("training", "use_input_stats", default=c.name != "_native_batch_norm_legit_no_training"))
    affine = w is not None and b is not None
    ins = [x] + ([w, b] if affine else []) + [t for t in (rm, rv) if t]
    return OpKind.NORM, ins, lambda: ops.batch_norm(c.shape(x), affine=affine, training=training)


@handles("group_norm", "native_group_norm")
def _group_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    affine = w is not None and b is not None
    ins = [x] + ([w, b] if affine else [])
    return OpKind.NORM, ins, lambda: ops.group_norm(c.shape(x), int(c.get("num_groups", "group")), affine=affine)


@handles("softmax", "_softmax", "log_softmax", "_log_softmax", "special_softmax")
def _softmax(c: Call) -> Spec:
    x = c.tensor("self", "input")
    log = "log" in c.name
    return OpKind.SOFTMAX, [x], lambda: ops.softmax(c.shape(x), int(c.get("dim")), log=log)
