"""Export a deep stack of alike blocks by tracing three of them.

``torch.export`` costs ~2 ms of CPU per traced op, so a 32- or 96-layer transformer spends
almost all of its capture tracing the same block again and again (2.4 s for LLaMA-3-8B, 10 s
for GPT-3 175B, and a search captures each model two or three times). When a module holds an
``nn.ModuleList`` of many blocks that are provably alike, :func:`export_folded` exports the
model with that list cut to its first three blocks and writes blocks 3..N-1 as copies of
block 2's nodes, each wired to its predecessor the way block 2 is wired to block 1. The
result is the node sequence a full export gives, names included: fx's own namer numbers the
nodes in order, exactly as the export did (``tests/test_capture_fold.py`` compares whole
captures with and without folding on the model zoo).

Blocks count as alike, and the copies are trusted, only when all of this holds (otherwise the
model is exported whole, as before):

- blocks 1..N-1 are distinct modules of one type with the same parameters and buffers (names,
  shapes, dtypes), none shared with another block, and the same plain attributes, except Hugging Face's
  ``layer_idx`` (each block's own index, read for the KV cache);
- every per-layer list of a ``config`` the model or its blocks carry (``layer_types``,
  ``sliding_window`` patterns...) has one value for all layers: per-layer behaviour that the
  parameters do not show (alternating local/global attention) would otherwise be copied wrong;
- in the three-block export, each block's nodes are contiguous, block 2 repeats block 1 node
  for node (same ops, same constant arguments, same shapes; references into its own block,
  into the previous block, to its own parameters, or to the very values block 1 reads from
  before the stack or from block 0), and nothing
  after the stack reads a block other than the last;
- replaying fx's namer over the three-block export gives back its own node names.

What no trace of three blocks can see is control flow in the parent's loop on a block index it
never reaches (``if i == 7: x = x * 0.5``); ``POLYPARALLEL_FOLD=0`` traces every block.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["MIN_BLOCKS", "FoldedProgram", "export_folded"]

MIN_BLOCKS = 6  # below this, one full export is about as cheap as the three-block one
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
# a block's own index, which Hugging Face blocks keep for their KV cache; any other attribute that
# differs between blocks may change what a block computes
_INDEX_ATTRS = frozenset({"layer_idx"})
_LIFTED = re.compile(r"lifted_tensor_(\d+)$")


@dataclass
class FoldedProgram:
    """The node sequence of a full export, built from a three-block one.

    ``inputs`` maps each placeholder's name to its input kind (``PARAMETER``, ``BUFFER``,
    ``USER_INPUT``...) and target (a parameter's or buffer's path in the full model);
    ``graph_module`` is the three-block export's (for ``get_attr`` nodes)."""

    graph: torch.fx.Graph
    inputs: dict[str, tuple[str, str | None]]
    graph_module: torch.fx.GraphModule
    stack: str  # path of the folded ModuleList
    blocks: int


def export_folded(model: nn.Module, export: Callable[[nn.Module], Any]) -> FoldedProgram | None:
    """Export ``model`` (``export(model)`` returns an ``ExportedProgram``) with its deepest
    stack of alike blocks traced three blocks deep; None when the model has no such stack or
    a check fails (the caller then exports it whole)."""
    if os.environ.get("POLYPARALLEL_FOLD", "1") == "0":
        return None
    found = _stack(model)
    if found is None:
        return None
    path, blocks, keep = found
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, attr, nn.ModuleList(list(blocks)[:keep]))
    try:
        ep = export(model)
    except Exception:  # e.g. a forward that indexes the list by a configured layer count
        return None
    finally:
        setattr(parent, attr, blocks)
    try:
        return _unfold(ep, path, len(blocks), keep)
    except _NotFoldable:
        return None


# ----------------------------------------------------------------------------------------
# which stack, and are its blocks alike


def _stack(model: nn.Module) -> tuple[str, nn.ModuleList, int] | None:
    """The biggest stack of alike blocks, and how many of its blocks to trace: three, or four
    when block 0 differs (it is traced, never copied)."""
    lists = [(p, m) for p, m in model.named_modules() if p and isinstance(m, nn.ModuleList) and len(m) >= MIN_BLOCKS]
    lists.sort(key=lambda pm: -sum(p.numel() for p in pm[1].parameters()))
    for path, blocks in lists[:1]:  # nested or second stacks are traced as they are
        keep = _alike(model, blocks)
        if keep:
            return path, blocks, keep
    return None


def _plain(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items()
            if not k.startswith("_") and isinstance(v, int | float | str | bool | tuple | type(None))}


def _layout(b: nn.Module) -> tuple:
    return (tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in b.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in b.named_buffers()),
            tuple(type(m).__name__ for m in b.modules()))


def _like(ref: nn.Module, r: int, b: nn.Module, i: int) -> bool:
    """Block ``b`` (index ``i``) like block ``ref`` (index ``r``): type, parameters, buffers,
    submodules and plain attributes (but the HF block index)."""
    if type(b) is not type(ref) or _layout(b) != _layout(ref):
        return False
    for m1, mi in zip(ref.modules(), b.modules(), strict=True):
        a1, ai = _plain(m1), _plain(mi)
        if a1.keys() != ai.keys():
            return False
        if any(a1[k] != ai[k] and not (k in _INDEX_ATTRS and (a1[k], ai[k]) == (r, i)) for k in a1):
            return False
    return True


def _alike(model: nn.Module, blocks: nn.ModuleList) -> int:
    """How many blocks to trace (3, or 4 when block 0 differs: T5's first block alone holds the
    position bias the others read from it), or 0 when blocks 1..N-1 are not all alike."""
    ref = blocks[1]
    if len({id(b) for b in blocks}) != len(blocks):
        return 0
    seen: set[int] = set()
    for b in blocks:
        ids = {id(p) for p in b.parameters()}
        if ids & seen:
            return 0
        seen |= ids
    if not all(_like(ref, 1, b, i) for i, b in enumerate(blocks) if i > 0):
        return 0
    configs = {id(c): c for m in [model, *ref.modules()] if (c := getattr(m, "config", None)) is not None}
    for c in configs.values():
        for v in vars(c).values():
            if isinstance(v, list | tuple) and len(v) == len(blocks) and len({repr(x) for x in v[1:]}) > 1:
                return 0
    return 3 if _like(ref, 1, blocks[0], 0) else 4


# ----------------------------------------------------------------------------------------
# the three-block export, checked and unfolded


def _block_of(node: torch.fx.Node, prefix: str) -> int | None:
    for p, _ in (node.meta.get("nn_module_stack") or {}).values():
        p = str(p)
        if p.startswith(prefix):
            head = p[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _base(name: str) -> str:
    m = _SUFFIX.match(name)
    return m.group(1) if m else name


def _retarget(v: Any, old: str, new: str) -> Any:
    """A module path of block ``old`` as the same path in block ``new``."""
    s = str(v)
    return new + s[len(old):] if s == old or s.startswith(old + ".") else v


def _unfold(ep: Any, path: str, n: int, keep: int) -> FoldedProgram | None:
    q, p, c = keep - 3, keep - 2, keep - 1  # block c repeats block p, which repeats block q
    prefix = path + "."
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    inputs = {k: (s.kind.name, s.target) for k, s in specs.items()}
    nodes = list(ep.graph.nodes)
    holders = [x for x in nodes if x.op == "placeholder"]
    body = [x for x in nodes if x.op != "placeholder"]

    def owner(x: torch.fx.Node) -> int | None:  # block of a parameter / buffer placeholder
        tgt = inputs.get(x.name, ("", None))[1] or ""
        if tgt.startswith(prefix):
            head = tgt[len(prefix):].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        return None

    # block k's segment: its nodes and the parent's nodes up to block k+1 (the loop's own work
    # between blocks, ``act(layer(x))``); the last block's segment is as long as its predecessor's
    where = [_block_of(x, prefix) for x in body]
    first = [next((i for i, b in enumerate(where) if b == k), None) for k in range(keep)]
    if None in first or first != sorted(first) or any(b is not None and b >= keep for b in where):
        return None
    ends = [*first[1:], first[c] + first[c] - first[p]]
    blk = [body[first[k]:ends[k]] for k in range(keep)]
    pre, post = body[:first[0]], body[ends[c]:]
    if ends[c] > len(body) or any(where[i] not in (k, None) for k in range(keep) for i in range(first[k], ends[k])) \
            or any(where[i] is not None for i in range(ends[c], len(body))):
        return None
    pos = [{x: i for i, x in enumerate(b)} for b in blk]
    # a placeholder a block owns, by its path inside the block; constants export lifts out of the
    # blocks (a KV cache's empty tensors) carry a counter over the whole model, ``lifted_tensor_7``,
    # so they are told apart by their order in the block instead
    own = [{x: inputs[x.name][1][len(f"{prefix}{k}."):] for x in holders if owner(x) == k} for k in range(keep)]
    for k in range(keep):
        lifted = [x for x in own[k] if _LIFTED.search(own[k][x])]
        for i, x in enumerate(lifted):
            own[k][x] = (_LIFTED.sub("lifted_tensor", own[k][x]), i)
    counters = [[int(_LIFTED.search(inputs[x.name][1]).group(1)) for x in own[k] if isinstance(own[k][x], tuple)]
                for k in range(keep)]
    per_block = len(counters[c])
    if per_block and any(counters[k] != list(range(counters[q][0] + (k - q) * per_block,
                                                   counters[q][0] + (k - q + 1) * per_block)) for k in (q, p, c)):
        return None  # not numbered block after block: the copies' numbers cannot be predicted
    shift = (n - keep) * per_block  # lifted constants after the stack are numbered past the copies'
    top = counters[c][-1] if per_block else None

    def renumber(text: str, by: int) -> str:
        m = _LIFTED.search(text)
        return text if m is None or not by else text[:m.start(1)] + str(int(m.group(1)) + by) + text[m.end(1):]

    # block c must repeat block p, one block later
    if len(blk[p]) != len(blk[c]):
        return None

    def same(a: Any, b: Any) -> bool:  # an argument of block 2's node against block 1's
        if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
            if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
                return False
            for k in (p, c):
                if a in pos[k]:
                    return b in pos[k - 1] and pos[k - 1][b] == pos[k][a]
                if a in own[k]:
                    return b in own[k - 1] and own[k - 1][b] == own[k][a]
            # the same value: shared (rotary tables, masks) or made once by an earlier block (T5's
            # position bias, made by block 0 alone)
            made_by = _block_of(a, prefix)
            return a is b and owner(a) is None and (made_by is None or made_by < p)
        if isinstance(a, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    for a, b in zip(blk[c], blk[p], strict=True):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if a.op != b.op or a.target != b.target or not same(a.args, b.args) or not same(a.kwargs, b.kwargs) \
                or _shapes(va) != _shapes(vb):
            return None
    # after the stack, only the last block's values (and parameters: ``layers[-1]``) are what they
    # are in the full model; before it, a reference to the three-block list's last block would be
    late = {x for k in range(c) for x in [*blk[k], *own[k]]}
    if any(u in late for x in post for u in x.all_input_nodes) or \
            any(u in own[c] for x in pre for u in x.all_input_nodes):
        return None

    g = torch.fx.Graph()
    new: dict[torch.fx.Node, torch.fx.Node] = {}
    out_inputs: dict[str, tuple[str, str | None]] = {}
    lp_s = path.replace(".", "_")
    copies: list[dict[torch.fx.Node, torch.fx.Node]] = [{} for _ in range(keep, n)]  # block c's node -> copy

    def emit(x: torch.fx.Node, name: str, args: Any, kwargs: Any, meta: dict) -> torch.fx.Node:
        y = g.create_node(x.op, x.target if x.op != "placeholder" else name, args, kwargs, name=name)
        y.meta = meta
        return y

    # placeholders come grouped by kind (parameters, buffers, constants, inputs), each group in
    # the model's order: blocks 3..N-1 go right after block 2's last placeholder of each kind
    kinds = [inputs.get(x.name, ("USER_INPUT", None))[0] for x in holders]
    last_of = {kd: max(i for i, x in enumerate(holders) if owner(x) == c and kinds[i] == kd)
               for kd in {kinds[i] for i, x in enumerate(holders) if owner(x) == c}}
    for i, x in enumerate(holders):
        kind, target = inputs.get(x.name, ("USER_INPUT", None))
        name = x.name
        if top is not None and owner(x) is None and target and (m := _LIFTED.search(target)) \
                and int(m.group(1)) > top:
            name, target = renumber(name, shift), renumber(target, shift)
        new[x] = emit(x, name, (), {}, dict(x.meta))
        out_inputs[name] = (kind, target)
        if last_of.get(kind) != i:
            continue
        for j, m in zip(range(keep, n), copies, strict=True):
            for h, kd in zip(holders, kinds, strict=True):
                if owner(h) != c or kd != kind:
                    continue
                old_s, new_s = f"{lp_s}_{c}_", f"{lp_s}_{j}_"
                if h.name.count(old_s) != 1:
                    raise _NotFoldable
                by = (j - c) * per_block if isinstance(own[c][h], tuple) else 0
                nm = renumber(h.name.replace(old_s, new_s), by)
                tgt = inputs[h.name][1]
                m[h] = emit(h, nm, (), {}, dict(h.meta))
                out_inputs[nm] = (kd, renumber(f"{prefix}{j}." + tgt[len(f"{prefix}{c}."):], by))

    def remap(v: Any, table: Callable[[torch.fx.Node], torch.fx.Node]) -> Any:
        return torch.fx.node.map_arg(v, table)

    for x in [*pre, *(x for b in blk for x in b)]:
        y = emit(x, _base(x.name), remap(x.args, new.__getitem__), remap(x.kwargs, new.__getitem__), dict(x.meta))
        if y.name != x.name:  # fx's namer does not replay this export's names: trust nothing
            raise _NotFoldable
        new[x] = y
    prev = {x: new[x] for x in blk[c]}  # block j-1's nodes, by block c's node
    old, cur_path = f"{prefix}{c}", None
    for j, params in zip(range(keep, n), copies, strict=True):
        cur_path = f"{prefix}{j}"
        cur: dict[torch.fx.Node, torch.fx.Node] = {}

        def table(a: torch.fx.Node, cur=cur, prev=prev, params=params, p=p, c=c) -> torch.fx.Node:
            if a in pos[c]:
                return cur[a]
            if a in pos[p]:  # block c read block p: the copy reads its predecessor
                return prev[blk[c][pos[p][a]]]
            if a in params:
                return params[a]
            return new[a]

        for x in blk[c]:
            meta = dict(x.meta)
            if "nn_module_stack" in meta:
                meta["nn_module_stack"] = {k: (_retarget(p, old, cur_path), t)
                                           for k, (p, t) in meta["nn_module_stack"].items()}
            cur[x] = emit(x, _base(x.name), remap(x.args, table), remap(x.kwargs, table), meta)
        prev = cur
    last = prev

    def tail(a: torch.fx.Node) -> torch.fx.Node:
        if a in own[c]:
            return copies[-1][a] if copies else new[a]
        return last[a] if a in pos[c] else new[a]

    for x in post:
        new[x] = emit(x, _base(x.name) if x.op != "output" else "output", remap(x.args, tail),
                      remap(x.kwargs, tail), dict(x.meta))
    return FoldedProgram(g, out_inputs, ep.graph_module, path, n)


class _NotFoldable(Exception):
    pass


def _shapes(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    if isinstance(v, list | tuple):
        return tuple(_shapes(x) for x in v)
    return repr(v) if v is not None else None
