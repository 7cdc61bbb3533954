r"""Sequence parallelism (Ulysses) and context parallelism (ring attention) inside pipeline stages:
a pass over the exported graph.

Pipeline stages are chunks of the model's ``torch.export`` graph (:mod:`._pipeline`), so the
``TorchFunctionMode`` and module hooks of the unpipelined Ulysses path (:mod:`._tensor_parallel`,
"Sequence parallelism") do not reach them. Instead the model is exported at the *local* sequence
length ``n = S/sp`` (one micro-batch's sequence shard), so every view size in the graph is already
the shard's, and this pass rewrites the graph before it is cut:

* each ``scaled_dot_product_attention`` becomes :func:`ulysses_attention`, the same all-to-alls
  (:class:`._sequence_parallel.UlyssesAttention`): ``q, k, v`` from sequence-sharded to head-sharded,
  attention over the whole sequence, the output back;
* an explicit attention mask computed from positions only (HF's causal mask, built from
  ``arange``\ s) is evaluated at the export; it is the causal mask of the shard, so it is dropped
  and the attention runs with ``is_causal=True`` over the whole sequence (any other mask, or one
  depending on the inputs, e.g. padding, is refused);
* every ``arange`` the remaining computation uses must be ``arange(n)``, the shard's positions
  (a position embedding's index, a rotary table's ``position_ids``), and becomes
  ``arange(r·n, (r+1)·n)`` on ``sp`` rank ``r``; any other ``arange`` is refused;
* the loss tail sees this rank's sequence shard of the labels. A tail that right-pads the labels
  by ``k`` before shifting them (HF causal LMs: ``pad(labels, (0, 1), -100)[:, 1:]``) needs the
  next shard's first ``k`` labels: the pad is removed from the graph and the workers feed the
  labels ``[r·n, (r+1)·n + k)`` of the sequence padded as the model pads it (:func:`label_shard`).

Under context parallelism (``ring=True``, ``sp`` then counts the ``cp`` shards) the same pass makes
each attention :func:`ring_attention_call` (:mod:`._context_parallel`), each ``arange(n)`` the
shard's load-balanced positions, and the labels the positions' (a right halo read at ``p + k``).

Gradients are averaged over the ``dp·sp`` ranks holding a stage's parameters, and the micro-batch
losses of every ``(dp, sp)`` replica are token-weighted as the pipeline does for ``dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from polyparallel.backends.torch._context_parallel import ring_attention, shard_positions
from polyparallel.backends.torch._sequence_parallel import UlyssesAttention, shard_along
from polyparallel.backends.torch.capabilities import Unsupported

__all__ = ["SPRewrite", "label_shard", "register_mesh", "ring_attention_call", "ulysses_attention"]

aten = torch.ops.aten
_MESHES: dict[str, Any] = {}  # the sp meshes the graph's all-to-alls run on, by name


def register_mesh(name: str, mesh: Any) -> None:
    """Name the 1-D ``sp`` mesh :func:`ulysses_attention` called with ``name`` exchanges over."""
    _MESHES[name] = mesh


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, mesh: str = "sp",
                      **kwargs: Any) -> torch.Tensor:
    """SDPA on sequence shards ``[B, h, n, d]``: all-to-all to ``[B, h/sp, S, d]``, attention, back."""
    u = UlyssesAttention(_MESHES[mesh])  # (its exchanges, not entered as a mode)
    out = aten.scaled_dot_product_attention.default(*(u.seq_to_heads(t) for t in (q, k, v)), *args, **kwargs)
    return u.heads_to_seq(out)


def ring_attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                        dropout_p: float = 0.0, is_causal: bool = False, *, mesh: str = "sp",
                        scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA on context-parallel shards ``[B, h, n, d]``: ring attention over the mesh named ``mesh``."""
    return ring_attention(q, k, v, _MESHES[mesh].get_group(), is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa, dropout_p=dropout_p)


def shard_arange(length: int, cp: int, rank: int, **kwargs: Any) -> torch.Tensor:
    """``arange(length/cp)`` on context-parallel shard ``rank``: the shard's positions."""
    out = shard_positions(length, cp, rank, kwargs.get("device"))
    return out.to(kwargs["dtype"]) if kwargs.get("dtype") is not None else out


@dataclass(frozen=True)
class SPRewrite:
    """What the pass did: the attentions rewritten, the aranges offset, the labels' right halo
    ``(k, value)`` the tail's pad needs (None without one)."""

    attentions: tuple[str, ...]
    positions: tuple[str, ...]
    halo: tuple[int, float] | None


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _evaluate(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The value of ``node``, computed from parameters, buffers and constants only."""
    nodes = _ancestors(node)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if inputs:
        raise Unsupported(f"attention mask {node.name!r} depends on the model inputs ({inputs[0].name}, e.g. a "
                          "padding mask): sequence parallelism inside pipeline stages runs causal or unmasked "
                          "attention only")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[node])
    with torch.no_grad():
        return fx.GraphModule(gm, g)()


def _causal(mask: torch.Tensor, n: int) -> bool:
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return False
    if allowed.dim() < 2 or allowed.shape[-2:] != (n, n):
        return False
    return bool((allowed == torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()).all())


def rewrite(gm: fx.GraphModule, sp: int, rank: int, n: int, mesh: str = "sp", ring: bool = False,
            tp: int = 1) -> SPRewrite:
    """Rewrite ``gm`` (exported at the local sequence length ``n``) for ``sp`` rank ``rank`` in place;
    ``ring``: for context-parallel shard ``rank`` of ``sp`` (ring attention, load-balanced positions).
    ``tp``: the tensor-parallel pass ran first, each rank holds ``1/tp`` of the heads (the graph's
    recorded shapes are still the whole model's)."""
    graph = gm.graph
    inputs = [x for x in graph.nodes if x.op == "placeholder"]
    labels = inputs[-1]
    attentions = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        shapes = [tuple(getattr(x.meta.get("val"), "shape", ())) for x in (q, k, v)]
        if any(len(s) != 4 or s[2] != n for s in shapes):
            raise Unsupported(f"attention {node.name!r}: q, k, v of shapes {shapes} are not [batch, heads, "
                              f"{n}, head_dim] sequence shards")
        if not ring and any(s[1] % (sp * tp) for s in shapes):
            raise Unsupported(f"attention {node.name!r}: {shapes[0][1]} heads do not split over tp·sp={tp * sp}")
        names = ["attn_mask", "dropout_p", "is_causal"]
        full = dict(zip(names, node.args[3:6]))
        full.update({a: node.kwargs[a] for a in names if a in node.kwargs})
        rest = {a: w for a, w in node.kwargs.items() if a not in names}
        mask = full.get("attn_mask")
        if isinstance(mask, fx.Node):
            if full.get("is_causal") or not _causal(_evaluate(gm, mask), n):
                raise Unsupported(f"attention {node.name!r} has an explicit mask other than the causal one: "
                                  "sequence parallelism inside pipeline stages does not execute it")
            full["is_causal"] = True
        node.target = ring_attention_call if ring else ulysses_attention
        node.args = (q, k, v, None, full.get("dropout_p", 0.0), bool(full.get("is_causal", False)))
        node.kwargs = {**rest, "mesh": mesh}
        attentions.append(node.name)
    if not attentions:
        raise Unsupported("the model has no scaled_dot_product_attention: no sequence dim to split over sp")
    out = next(x for x in graph.nodes if x.op == "output")
    live = set(_ancestors(out))
    positions = []
    for node in graph.nodes:
        if node not in live or node.op != "call_function" or node.target not in (aten.arange.default,
                                                                                  aten.arange.start):
            continue
        bounds = tuple(node.args) if node.target is aten.arange.start else (0, *node.args)
        if bounds != (0, n):
            raise Unsupported(f"op {node.name!r} is arange{bounds}, not the {n} positions of a sequence shard: "
                              "sequence parallelism inside pipeline stages offsets positions only")
        if ring:
            node.target, node.args = shard_arange, (sp * n, sp, rank)
            node.kwargs = {k: w for k, w in node.kwargs.items() if k in ("dtype", "device")}
        else:
            node.target, node.args = aten.arange.start, (rank * n, (rank + 1) * n)
        positions.append(node.name)
    halo = None
    readers = [u for u in labels.users if u.op == "call_function"]  # (not export's shape guard)
    for u in readers:
        if u.target in (aten.pad.default, aten.constant_pad_nd.default):
            pad = list(u.args[1])
            mode = u.args[2] if len(u.args) > 2 else u.kwargs.get("mode", "constant")
            value = u.args[3] if len(u.args) > 3 else u.kwargs.get("value", 0.0)
            nd = len(getattr(labels.meta.get("val"), "shape", ()))
            if nd == 2 and len(pad) == 2 and pad[0] == 0 and mode == "constant" and len(readers) == 1:
                halo = (int(pad[1]), float(value if value is not None else 0.0))
                u.replace_all_uses_with(labels)
                graph.erase_node(u)
                continue
            raise Unsupported(f"the loss pads the labels ({u.name}: {pad}) other than on the right of the sequence "
                              "alone: not executed with sequence parallelism inside pipeline stages")
    graph.lint()
    gm.recompile()
    return SPRewrite(tuple(attentions), tuple(positions), halo)


def label_shard(y: torch.Tensor, sp: int, rank: int, halo: tuple[int, float] | None,
                ring: bool = False) -> torch.Tensor:
    """The labels the rewritten loss tail reads: the shard, plus the next ``k`` labels of the sequence
    (the model's pad value past its end) when the model pads them before shifting. The tail drops
    the first ``k`` of what it reads; under context parallelism what remains must be the labels at
    ``p + k`` for each of the shard's positions ``p``, so those are gathered after ``k`` fillers."""
    if halo is None:
        return shard_along(y, 1, sp, rank, ring)
    k, value = halo
    padded = torch.nn.functional.pad(y, (0, k), value=value)
    if ring:
        pos = shard_positions(y.shape[1], sp, rank, y.device)
        return padded.index_select(1, torch.cat([pos[:k], pos + k]))
    n = y.shape[1] // sp
    return padded[:, rank * n:(rank + 1) * n + k]
