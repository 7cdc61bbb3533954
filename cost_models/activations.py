"""What a training step keeps for its backward, and at which widths the torch backend holds tensors.

:func:`kept_tensors` lists autograd's saved tensors of a captured graph (what each op's backward
keeps: torch's ``derivatives.yaml``, the elementwise ops' tables in :mod:`polyparallel.ops`),
:func:`activation_bytes` what one op stores, :func:`segment_activations` the sums per layer segment,
:func:`recomputed_segments` and :func:`segment_inputs` what full recomputation checkpoints and keeps.
:func:`sent_widths` gives the bytes per element of every tensor as the torch backend holds it under
``torch.autocast`` (the widths pipeline transfers and autocast's casts are priced at),
:func:`crossing` the tensors read after the op that writes them, and :func:`loss_transient` the peak
an eager cross-entropy adds.
"""

from __future__ import annotations

import math

from polyparallel.cluster import DeviceType
from polyparallel.ir import (
    DTYPE_BYTES,
    FLOAT_DTYPES,
    TRAINING_DTYPE_BYTES,
    Graph,
    Op,
    OpKind,
    TensorKind,
    element_bytes,
)
from polyparallel.ops import DROPOUT_TARGETS, NO_GRAD, SAVES_OPERANDS, aten_name, backward_saves

from .compute import AUTOCAST_LOW, is_sdpa, math_sdpa_saved_bytes, math_sdpa_upcasts
from .layers import LAYER, chunks, segments
from .megatron_rule import op_plans, tensor_bytes
from .memo import PRICES
from .parallel_config import OpPlan, ParallelConfig

__all__ = ["activation_bytes", "crossing", "kept_tensors", "loss_transient", "op_policy_kept", "op_policy_recomputed",
           "op_policy_saved", "recomputed_segments", "segment_activations", "segment_inputs", "sent_widths"]


def _dropout_masks(op: Op) -> int:
    """How many dropout masks ``op`` keeps for its backward: itself a dropout, or dropouts absorbed
    into it (``attrs["fused"]``); each is one byte per element of the op's output."""
    return sum(aten_name(t) in DROPOUT_TARGETS for t in (op.target, *op.attr.get("fused", ())))


def _fused_temporaries(op: Op) -> int:
    """Intermediate values of a fused elementwise chain (``attrs["fused"]``: the producer's output
    ``v_0``, then each absorbed op's) that eager torch keeps for the backward: ``v_{i-1}`` when the
    ``i``-th absorbed op saves its input, ``v_i`` when it saves its output (the last, the op's
    output, is counted with the outputs). GPT's ``gelu(fc(x))`` keeps the pre-activation; LLaMA's
    ``silu(gate(x)) * up`` the gate's output and the silu's."""
    kept: set[int] = set()
    chain = op.attr.get("fused", ())
    if chain and (OpKind(op.kind) is OpKind.SOFTMAX or (OpKind(op.kind) is OpKind.ELEMENTWISE
                                                        and backward_saves(op.target) == "output")):
        kept.add(0)  # the op's own output, which its backward reads (a softmax's probabilities before a dropout)
    # the absorbed ops' statements, appended last by fuse_elementwise in the chain's order
    absorbed = op.nest.statements[len(op.nest.statements) - len(chain):] if op.nest is not None and chain else ()
    for i, target in enumerate(chain, start=1):
        how = "nothing" if aten_name(target) in NO_GRAD else backward_saves(target)
        if aten_name(target) in ("mul", "div") and i <= len(absorbed) and len(absorbed[i - 1].reads) == 1:
            how = "nothing"  # by a constant (attention's scale): autograd saves the constant only
        if how == "input":
            kept.add(i - 1)
        elif how == "output" and i < len(chain):
            kept.add(i)
    return len(kept)


def kept_tensors(graph: Graph) -> tuple[frozenset[str], dict[str, int]]:
    """The activations eager torch keeps alive for the backward: autograd's saved tensors.

    A tensor is kept when an op recorded by autograd (one with an input that requires grad) saves
    it: contractions, convolutions, norms and attention save their activation inputs (a Linear its
    input, a matmul both operands); an elementwise op its input (gelu, silu, pow, ...; ``mul`` each
    operand when the other requires grad), its output (relu, exp, rsqrt, ...) or nothing (add, sub,
    casts, comparisons); softmax its output; the loss its logits (its log-softmax, the same size);
    reductions (mean, sum), concatenations, splits and index gathers none of their float inputs.
    A kept view keeps the tensor it views. An op's fused elementwise chain saves what its ops save
    (:func:`_fused_temporaries`); its extra inputs are kept when the chain multiplies by them.
    Returns the kept tensors and, per op recorded by autograd, its kept fused temporaries."""
    cache = PRICES.of(graph)
    if ("kept",) in cache:
        return cache[("kept",)]
    grad = {n for n, t in graph.tensors.items() if t.kind is TensorKind.PARAM}
    temps: dict[str, int] = {}
    producer = {t: op for op in graph.ops for t in op.outputs}
    kept: set[str] = set()

    def keep(t: str) -> None:
        while True:
            p = producer.get(t)
            if p is not None and OpKind(p.kind) is OpKind.VIEW and p.inputs:
                t = p.inputs[0]  # a view's storage is its input's
                continue
            kept.add(t)
            return

    for op in graph.ops:
        acts = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM]
        floats = [t for t in acts if graph.tensors[t].dtype in FLOAT_DTYPES]
        if not any(t in grad for t in op.inputs):
            continue  # autograd records nothing
        kind, base = OpKind(op.kind), aten_name(op.target)
        chain = op.attr.get("fused", ())
        if base not in NO_GRAD:
            grad.update(t for t in op.outputs if graph.tensors[t].dtype in FLOAT_DTYPES)
        main = acts
        temps[op.name] = _fused_temporaries(op)
        if chain and kind in (OpKind.CONTRACTION, OpKind.CONV, OpKind.ELEMENTWISE):
            # the fused op's own inputs come first, those of the absorbed ops after them
            if kind is OpKind.ELEMENTWISE:
                n_main = 2 if base in SAVES_OPERANDS or base in ("add", "sub", "rsub") else 1
            else:
                n_main = 1 if any(graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs) else 2
            main = [t for t in acts if t in floats[:n_main] or t not in floats]
            if any(aten_name(c) in SAVES_OPERANDS for c in chain):
                for t in floats[n_main:]:
                    keep(t)
        if kind is OpKind.ATTENTION:
            for t in floats:
                keep(t)  # q, k, v (a boolean mask is not kept: torch's kernels take it as is)
        elif kind in (OpKind.CONTRACTION, OpKind.CONV, OpKind.NORM, OpKind.LOSS, OpKind.OPAQUE):
            for t in main:
                keep(t)
        elif kind is OpKind.EMBEDDING or kind is OpKind.GATHER:
            for t in acts:
                if t not in floats:
                    keep(t)  # the indices
        elif kind is OpKind.POOL and "max" in base:
            for t in main:
                keep(t)
        elif kind is OpKind.ELEMENTWISE and base not in NO_GRAD:
            how = backward_saves(op.target)
            if how == "input":
                for t in main:
                    if t in floats and (base not in SAVES_OPERANDS or any(o in grad for o in main if o != t)):
                        keep(t)
            elif how == "output" and not chain:
                kept.update(op.outputs)
        elif kind is OpKind.SOFTMAX or (kind is OpKind.REDUCE and "softmax" in base):
            kept.update(op.outputs)
        elif kind is OpKind.REDUCE and base in ("amax", "max", "min", "amin", "prod", "var", "std", "norm"):
            for t in main:
                keep(t)
        if chain and backward_saves(chain[-1]) == "output":
            kept.update(op.outputs)
    cache[("kept",)] = (frozenset(kept), temps)
    return cache[("kept",)]


def activation_bytes(graph: Graph, op: Op, dtype: str, fused_attention: bool | None, selective: bool,
                      math_sdpa: bool = False, mask_bytes: float = 1.0) -> float:
    """Bytes an op stores for its backward: its outputs, the temporaries of its fused elementwise
    chain that eager torch keeps, and for attention what its kernel keeps.

    ``scaled_dot_product_attention`` runs as torch's fused kernels (flash / memory-efficient, on
    CPU the flash kernel), which keep the output and the softmax's log-sum-exp (``B·H·S`` fp32), never
    the ``S×S`` scores (its inputs q, k, v are their producers' outputs, counted there); under
    selective recomputation the checkpoint drops the log-sum-exp too. ``math_sdpa``: it runs as
    torch's upcast math kernel instead (an accelerator, 16 bits, no fused kernel), which keeps fp32
    probabilities and fp32 copies of q, k and v (:func:`math_sdpa_saved_bytes`; measured on an H200,
    GPT-1.7B at batch 4 x 2048: 85.7 GB against 43.9 with flash attention). Any other attention op keeps
    its scores and probabilities unless ``fused_attention`` says it runs as a fused kernel, and
    selective recomputation drops them (Korthikanti et al., 2022). A dropout (or one absorbed into
    the op) keeps its mask, ``mask_bytes`` per element of the output."""
    if OpKind(op.kind) in (OpKind.VIEW, OpKind.CREATE):
        return 0.0
    kept, temps = kept_tensors(graph)
    total = sum(tensor_bytes(graph, t, dtype) for t in op.outputs if t in kept)
    if op.outputs:
        total += temps.get(op.name, 0) * tensor_bytes(graph, op.outputs[0], dtype)
        total += _dropout_masks(op) * graph.tensors[op.outputs[0]].numel * mask_bytes
    if is_sdpa(op) and math_sdpa and op.nest is not None:
        if not selective:
            total += math_sdpa_saved_bytes(op)
    elif is_sdpa(op):
        if not selective:
            total += _log_sum_exp_bytes(graph, op)
    elif OpKind(op.kind) is OpKind.ATTENTION and op.nest is not None and not fused_attention and not selective:
        ext = op.nest.extents
        for st in op.nest.statements:
            for w in st.writes:
                if w.operand == "scores":
                    n = math.prod(ext[d] for e in w.index for d in e.dims)
                    total += 2 * n * TRAINING_DTYPE_BYTES[dtype]  # scores and probabilities
    return total


def _log_sum_exp_bytes(graph: Graph, op: Op) -> float:
    """What a fused attention kernel keeps beside its output: the softmax's log-sum-exp, fp32, one
    per output row (``B·H·S·4`` bytes)."""
    if not op.outputs:
        return 0.0
    out = graph.tensors[op.outputs[0]]
    return out.numel / max(out.shape[-1], 1) * 4 if out.shape else 0.0


def loss_transient(graph: Graph, cfg: ParallelConfig, v: int, eager: bool) -> dict[int, float]:
    """Bytes an eager cross-entropy adds at the start of the backward pass, per pipeline stage.

    Eager PyTorch computes the loss in fp32 (autocast upcasts it): ``log_softmax`` of the ``N``
    logits is saved for the backward (``4N`` bytes), whose start allocates the gradient of the
    log-probabilities and of the logits (``4N`` each) while they are still held, a peak of ``12N``
    bytes where the activations count the logits once at the compute precision. A fused loss
    kernel keeps none of it: Megatron's vocabulary-parallel cross entropy (``fused_elementwise``)
    writes its gradient in place; flash-attn's (``fused_loss``) allocates the logits' gradient at
    their width. ``N`` is the op's local share of its input (a vocabulary-parallel split divides it).
    """
    if cfg.fused_loss is None and not eager:
        return {}
    key = ("loss_ws", cfg.pp, v, cfg.partition, cfg.dtype, *cfg.split_key, cfg.op_plans,
           cfg.fused_loss)
    cache = PRICES.of(graph)
    if key not in cache:
        chunk_of_op = chunks(graph, cfg.pp * v, cfg.partition)
        plans = op_plans(graph, cfg)
        out: dict[int, float] = {}
        losses = cache.get(("loss_ops",))
        if losses is None:
            losses = cache[("loss_ops",)] = [i for i, op in enumerate(graph.ops)
                                             if OpKind(op.kind) is OpKind.LOSS and op.inputs]
        for i in losses:
            op = graph.ops[i]
            spec = graph.tensors[op.inputs[0]]
            if spec.dtype not in ("float32", "float16", "bfloat16"):
                continue
            n = spec.numel / plans[i].split
            logits = tensor_bytes(graph, op.inputs[0], cfg.dtype) / plans[i].split
            extra = logits if cfg.fused_loss else 12 * n - logits
            stage = chunk_of_op[i] % cfg.pp
            out[stage] = out.get(stage, 0.0) + max(extra, 0.0)
        cache[key] = out
    return cache[key]


def segment_activations(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan], device: DeviceType) -> list[float]:
    selective = cfg.recompute == "selective"
    math_sdpa = cfg.fused_attention is False and math_sdpa_upcasts(device, cfg.dtype)
    # a dropout keeps a boolean mask on accelerators (native_dropout); torch's CPU dropout multiplies
    # by a float noise tensor, which autograd keeps at the compute width
    mask = 1.0 if device.kind != "cpu" else float(TRAINING_DTYPE_BYTES[cfg.dtype])
    key = ("seg_act", *cfg.split_key, cfg.dtype, cfg.fused_attention, selective,
           cfg.op_plans, math_sdpa, mask)
    cache = PRICES.of(graph)
    if key not in cache:
        op_key = ("op_act", cfg.dtype, cfg.fused_attention, selective, math_sdpa, mask)
        if op_key not in cache:
            cache[op_key] = [activation_bytes(graph, op, cfg.dtype, cfg.fused_attention, selective, math_sdpa, mask)
                             for op in graph.ops]
        act = cache[op_key]
        cache[key] = [sum(act[i] / plans[i].split for i in sg) for sg in segments(graph)]
    return cache[key]


def op_policy_saved(graph: Graph) -> list[bool]:
    """Per op, whether the operator policy of ``recompute="op"`` keeps its output: in each
    checkpointed segment (:func:`recomputed_segments`) every second matrix product with a weight
    (a Linear: the 1st, 3rd, ... in execution order) and every fused attention
    (``scaled_dot_product_attention``); everything else there is recomputed in the backward. Ops
    outside those segments keep what they keep without recomputation (``True``).

    It is torchtitan's "selective op" activation checkpointing (``torchtitan/models/llama/
    parallelize_llama.py``: save ``aten.mm`` outputs except every second one, and the flash /
    memory-efficient attention outputs), which the torch backend runs (``_recompute.py``)."""
    cache = PRICES.of(graph)
    if ("op_saved",) not in cache:
        out = [True] * len(graph.ops)
        for sg, rec in zip(segments(graph), recomputed_segments(graph)):
            if not rec:
                continue
            n_mm = 0
            for i in sg:
                op = graph.ops[i]
                kind = OpKind(op.kind)
                if kind is OpKind.CONTRACTION and any(graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs):
                    n_mm += 1
                    out[i] = n_mm % 2 == 1
                else:
                    out[i] = is_sdpa(op)
        cache[("op_saved",)] = out
    return cache[("op_saved",)]


def op_policy_recomputed(graph: Graph) -> list[bool]:
    """Per op, whether the operator policy runs it again in the backward: in a checkpointed segment,
    an op whose output it does not keep, up to the last one whose output the backward needs (a
    tensor autograd saves: :func:`kept_tensors`). torch's non-reentrant checkpoint stops the
    recomputation there (``set_checkpoint_early_stop``), so a layer's trailing projection and
    residual add, needed by no saved tensor, do not run twice."""
    cache = PRICES.of(graph)
    if ("op_recomputed",) not in cache:
        saved, (kept, _) = op_policy_saved(graph), kept_tensors(graph)
        out = [False] * len(graph.ops)
        for sg, rec in zip(segments(graph), recomputed_segments(graph)):
            if not rec:
                continue
            inside = set(sg)
            readers: dict[str, list[int]] = {}
            for i in sg:
                for t in graph.ops[i].inputs:
                    readers.setdefault(t, []).append(i)
            # an output an op of this segment saves for its backward (a tensor read only by the
            # next layer is that layer's checkpointed input, kept anyway)
            needed = [i for i in sg if not saved[i] and any(
                t in kept and any(r in inside for r in readers.get(t, ())) for t in graph.ops[i].outputs)]
            last = max(needed, default=-1)
            for i in sg:
                out[i] = not saved[i] and i <= last
        cache[("op_recomputed",)] = out
    return cache[("op_recomputed",)]


def op_policy_kept(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan]) -> list[float]:
    """Per segment, the bytes the operator policy (:func:`op_policy_saved`) keeps of a checkpointed
    segment beside its inputs: the kept ops' outputs at their split sizes (an attention's with its
    fp32 log-sum-exp, ``B·H·S·4``); 0 for segments that are not checkpointed."""
    key = ("op_kept", cfg.dtype, *cfg.split_key, cfg.op_plans)
    cache = PRICES.of(graph)
    if key not in cache:
        saved = op_policy_saved(graph)
        out = []
        for sg, rec in zip(segments(graph), recomputed_segments(graph)):
            total = 0.0
            for i in sg if rec else ():
                op = graph.ops[i]
                if not saved[i] or not op.outputs:
                    continue
                nbytes = tensor_bytes(graph, op.outputs[0], cfg.dtype)
                if is_sdpa(op):
                    nbytes += _log_sum_exp_bytes(graph, op)
                total += nbytes / plans[i].split
            out.append(total)
        cache[key] = out
    return cache[key]


def recomputed_segments(graph: Graph) -> list[bool]:
    """Which layer segments full recomputation checkpoints: the numbered layers, or every run of
    ``√n`` ops in a graph without numbered layers."""
    cache = PRICES.of(graph)
    if ("recomputed",) not in cache:
        segs = segments(graph)
        layer = [bool(LAYER.match(graph.ops[sg[0]].module or "")) for sg in segs]
        cache[("recomputed",)] = layer if any(layer) else [True] * len(segs)
    return cache[("recomputed",)]


def segment_inputs(graph: Graph, dtype: str) -> list[float]:
    """Bytes full recomputation keeps per layer segment besides the activations it does not recompute.

    A recomputed segment keeps its inputs (each layer's input); a segment it does not recompute
    also keeps the inputs it reads from recomputed ones (the head's input after the last layer),
    which its own ops save for their backward. Tensors written by ops that are not recomputed are
    counted with those ops' activations, once."""
    key = ("seg_in", dtype)
    cache = PRICES.of(graph)
    if key not in cache:
        segs, rec = segments(graph), recomputed_segments(graph)
        by_rec = {t: rec[j] for j, sg in enumerate(segs) for i in sg for t in graph.ops[i].outputs}
        out = []
        for j, sg in enumerate(segs):
            produced = {t for i in sg for t in graph.ops[i].outputs}
            ins = {t for i in sg for t in graph.ops[i].inputs
                   if graph.tensors[t].kind is not TensorKind.PARAM and t not in produced
                   and by_rec.get(t, rec[j])}
            out.append(sum(tensor_bytes(graph, t, dtype) for t in ins))
        cache[key] = out
    return cache[key]


def sent_widths(graph: Graph, dtype: str, low_params: bool) -> dict[str, float]:
    """Bytes per element of every tensor as the torch backend holds it in training at ``dtype``.

    fp32: every float tensor 4. bf16/fp16 run under autocast with fp32 parameters (or, where
    FSDP2 shards them with ``MixedPrecisionPolicy``, ``low_params``, parameters cast to ``dtype``):
    contractions, convolutions and attention compute in ``dtype`` (autocast's lower-precision list,
    :data:`~polyparallel.cost_models.compute.AUTOCAST_LOW`), the loss and
    layer/group norms in fp32 (its fp32 list), batch norm in its input's dtype (cuDNN's), a cast to
    its dtype, and every other op promotes its float inputs as torch does. So a
    residual stream that adds a bf16 projection to fp32 embeddings stays fp32 (what a pipeline
    stage sends), unless FSDP2 made the embeddings bf16."""
    key = ("widths", dtype, low_params)
    cache = PRICES.of(graph)
    if key in cache:
        return cache[key]
    low = float(TRAINING_DTYPE_BYTES.get(dtype, 4))
    width: dict[str, float] = {}
    floats = FLOAT_DTYPES
    for name, t in graph.tensors.items():
        if t.dtype not in floats:
            width[name] = float(DTYPE_BYTES.get(t.dtype, 4))
        elif low < 4 and t.kind is TensorKind.PARAM and low_params:
            width[name] = low
        elif t.kind is not TensorKind.ACTIVATION:
            width[name] = 4.0 if low < 4 else float(element_bytes(t.dtype, dtype))
    for op in graph.ops:
        ins = [width.get(t, 4.0) for t in op.inputs if graph.tensors[t].dtype in floats]
        kind = OpKind(op.kind)
        cast = op.attr.get("dtype")
        if low >= 4:
            w = low
        elif kind in AUTOCAST_LOW:
            others = [width.get(t, 4.0) for t in op.inputs[2:] if graph.tensors[t].dtype in floats
                      and graph.tensors[t].kind is not TensorKind.PARAM]
            # a fused epilogue (the residual add) promotes to its other inputs' width
            w = max([low, *others]) if op.attr.get("fused") else low
        elif kind is OpKind.LOSS:
            w = 4.0
        elif kind is OpKind.NORM and "batch_norm" in op.target:
            # cuDNN's batch norm returns its input's dtype whatever its fp32 affine parameters and statistics
            w = max([width.get(t, 4.0) for t in op.inputs if graph.tensors[t].dtype in floats
                     and graph.tensors[t].kind in (TensorKind.ACTIVATION, TensorKind.INPUT)], default=4.0)
        elif kind is OpKind.NORM and ("layer_norm" in op.target or "group_norm" in op.target):
            w = 4.0  # autocast's fp32 list
        elif isinstance(cast, str) and cast.startswith("torch."):
            w = {"torch.float32": 4.0, "torch.bfloat16": 2.0, "torch.float16": 2.0}.get(cast, max(ins, default=4.0))
        else:
            w = max(ins, default=4.0)
        for t in op.outputs:
            if graph.tensors[t].dtype in floats:
                width[t] = w
            else:
                width.setdefault(t, float(DTYPE_BYTES.get(graph.tensors[t].dtype, 4)))
    cache[key] = width
    return width


def crossing(graph: Graph, dtype: str, low_params: bool = False) -> list[tuple[int, int, float]]:
    """(producer op, last consumer op, bytes) of every tensor read after the op that writes it, in op
    order; the bytes as the executor holds and sends it (:func:`sent_widths`)."""
    key = ("crossing", dtype, low_params)
    cache = PRICES.of(graph)
    if key not in cache:
        last: dict[str, int] = {}
        for i, op in enumerate(graph.ops):
            for t in op.inputs:
                last[t] = i
        width = sent_widths(graph, dtype, low_params)
        cache[key] = [(i, last[t], graph.tensors[t].numel * width[t]) for i, op in enumerate(graph.ops)
                      for t in op.outputs if last.get(t, -1) > i]
    return cache[key]
