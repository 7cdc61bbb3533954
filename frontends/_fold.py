"""Export a deep stack of alike blocks by tracing three of them.

``torch.export`` costs ~2 ms of CPU per traced op, so a 32- or 96-layer transformer spends
almost all of its capture tracing the same block again and again (2.4 s for LLaMA-3-8B, 10 s
for GPT-3 175B, and a search captures each model two or three times). When a module holds an
``nn.ModuleList`` of many blocks that are provably alike, :func:`export_folded` exports the
model with that list cut to its first three blocks and writes blocks 3..N-1 as copies of
block 2's nodes, each wired to its predecessor the way block 2 is wired to block 1. The
result is the node sequence a full export gives, names included: fx's own namer numbers the
nodes in order, exactly as the export did (``tests/test_capture_fold.py`` compares whole
captures with and without folding on the model zoo). The torch backend cuts pipeline stages from
the same program, run as a module over the model's own parameters (:meth:`FoldedProgram.module`).

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
from torch.fx._lazy_graph_module import _make_graph_module

__all__ = ["MIN_BLOCKS", "FoldedProgram", "export_folded", "input_kinds"]

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
    ``graph_module`` is the three-block export's (for ``get_attr`` nodes); ``outputs`` the kind of
    each output (``USER_OUTPUT``, ``BUFFER_MUTATION``...)."""

    graph: torch.fx.Graph
    inputs: dict[str, tuple[str, str | None]]
    graph_module: torch.fx.GraphModule
    outputs: tuple[str, ...] = ()
    single: bool = False  # the model returns one value, not a tuple or dict of them

    def module(self, root: nn.Module) -> torch.fx.GraphModule | None:
        """The program as a module that runs: what ``ExportedProgram.module()`` gives for the full
        export, with parameters and buffers read from ``root`` (the full model, shared, not copied)
        and the user inputs as positional arguments; it returns the flat outputs (a single one as
        itself). The module takes over this program's graph. None when the program lifts constants
        or returns anything but user outputs (buffer mutations, tokens): export the model whole."""
        g = self.graph
        holders = [x for x in g.nodes if x.op == "placeholder"]
        kinds = [self.inputs.get(x.name, ("USER_INPUT", None)) for x in holders]
        if any(kd != "USER_OUTPUT" for kd in self.outputs) or any(x.op == "get_attr" for x in g.nodes) or \
                any(kd not in ("PARAMETER", "BUFFER", "USER_INPUT") or (kd != "USER_INPUT" and t is None)
                    for kd, t in kinds):
            return None
        first = next(x for x in g.nodes if x.op != "placeholder")
        for x, (kind, target) in zip(holders, kinds, strict=True):
            if kind != "USER_INPUT":
                with g.inserting_before(first):
                    y = g.get_attr(target)
                y.meta = x.meta
                x.replace_all_uses_with(y)
                g.erase_node(x)
        if self.single:
            out = next(x for x in g.nodes if x.op == "output")
            out.args = (out.args[0][0],)
        # the lazy kind when asked for (``_use_lazy_graph_module``): its code is generated when it
        # is first called, never for a check that only reads the graph
        return _make_graph_module(root, g)


def input_kinds(ep: Any) -> dict[str, tuple[str, str | None]]:
    """Each placeholder of an ``ExportedProgram``: its input kind (``PARAMETER``, ``BUFFER``,
    ``CONSTANT_TENSOR``, ``USER_INPUT``...) and target (a parameter's path in the model)."""
    return {s.arg.name: (s.kind.name, s.target) for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}


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
    if not lists:
        return None
    # the list holding the most parameters; nested or second stacks are traced as they are
    path, blocks = max(lists, key=lambda pm: sum(p.numel() for p in pm[1].parameters()))
    keep = _alike(model, blocks)
    return (path, blocks, keep) if keep else None


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
    u = _Unfolder(ep, path, n, keep)
    return u.build() if u.segments() and u.number_lifted() and u.repeats() else None


class _Unfolder:
    """The three-block export (``keep`` blocks traced) checked and unfolded to ``n`` blocks.

    Block ``c`` (the last traced) repeats block ``p``, which repeats block ``q``; blocks ``c+1..n-1``
    are written as copies of block ``c``."""

    def __init__(self, ep: Any, path: str, n: int, keep: int) -> None:
        self.ep, self.path, self.n, self.keep = ep, path, n, keep
        self.q, self.p, self.c = keep - 3, keep - 2, keep - 1
        self.prefix = path + "."
        self.inputs = input_kinds(ep)
        nodes = list(ep.graph.nodes)
        self.holders = [x for x in nodes if x.op == "placeholder"]
        self.body = [x for x in nodes if x.op != "placeholder"]

    def owner(self, x: torch.fx.Node) -> int | None:
        """The block owning a parameter / buffer / constant placeholder."""
        tgt = self.inputs.get(x.name, ("", None))[1] or ""
        if tgt.startswith(self.prefix):
            head = tgt[len(self.prefix):].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        return None

    def segments(self) -> bool:
        """Block k's segment: its nodes and the parent's nodes up to block k+1 (the loop's own work
        between blocks, ``act(layer(x))``); the last block's is as long as its predecessor's."""
        body, keep, p, c = self.body, self.keep, self.p, self.c
        where = [_block_of(x, self.prefix) for x in body]
        first = [next((i for i, b in enumerate(where) if b == k), None) for k in range(keep)]
        if None in first or first != sorted(first) or any(b is not None and b >= keep for b in where):
            return False
        ends = [*first[1:], first[c] + first[c] - first[p]]
        strays = any(where[i] not in (k, None) for k in range(keep) for i in range(first[k], ends[k]))
        if ends[c] > len(body) or strays or any(where[i] is not None for i in range(ends[c], len(body))):
            return False
        self.blk = [body[first[k]:ends[k]] for k in range(keep)]
        self.pre, self.post = body[:first[0]], body[ends[c]:]
        self.pos = [{x: i for i, x in enumerate(b)} for b in self.blk]
        # a placeholder a block owns, by its path inside the block
        self.own = [{x: self.inputs[x.name][1][len(f"{self.prefix}{k}."):] for x in self.holders
                     if self.owner(x) == k} for k in range(keep)]
        return True

    def number_lifted(self) -> bool:
        """Constants export lifts out of the blocks (a KV cache's empty tensors) carry a counter over
        the whole model, ``lifted_tensor_7``: they are told apart by their order in the block, and
        must be numbered block after block for the copies' numbers to be predictable."""
        own, q, c = self.own, self.q, self.c
        for k in range(self.keep):
            for i, x in enumerate([x for x in own[k] if _LIFTED.search(own[k][x])]):
                own[k][x] = (_LIFTED.sub("lifted_tensor", own[k][x]), i)
        counters = [[int(_LIFTED.search(self.inputs[x.name][1]).group(1)) for x in own[k]
                     if isinstance(own[k][x], tuple)] for k in range(self.keep)]
        self.per_block = per = len(counters[c])
        self.top = counters[c][-1] if per else None
        return not per or all(counters[k] == list(range(counters[q][0] + (k - q) * per,
                                                        counters[q][0] + (k - q + 1) * per)) for k in (q, self.p, c))

    def _same(self, a: Any, b: Any) -> bool:
        """An argument of block c's node against block p's at the same position."""
        pos, own, p = self.pos, self.own, self.p
        if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
            if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
                return False
            for k in (p, self.c):
                if a in pos[k]:
                    return b in pos[k - 1] and pos[k - 1][b] == pos[k][a]
                if a in own[k]:
                    return b in own[k - 1] and own[k - 1][b] == own[k][a]
            # the same value: shared (rotary tables, masks) or made once by an earlier block (T5's
            # position bias, made by block 0 alone)
            made_by = _block_of(a, self.prefix)
            return a is b and self.owner(a) is None and (made_by is None or made_by < p)
        if isinstance(a, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(self._same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(self._same(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    def repeats(self) -> bool:
        """Block c repeats block p one block later, and the values before and after the stack read
        only what they read in the full model."""
        blk, own, c = self.blk, self.own, self.c
        if len(blk[self.p]) != len(blk[c]):
            return False
        for a, b in zip(blk[c], blk[self.p], strict=True):
            if a.op != b.op or a.target != b.target or not self._same(a.args, b.args) \
                    or not self._same(a.kwargs, b.kwargs) or _shapes(a.meta.get("val")) != _shapes(b.meta.get("val")):
                return False
        # after the stack, only the last block's values (and parameters: ``layers[-1]``) are what they
        # are in the full model; before it, a reference to the three-block list's last block would be
        late = {x for k in range(c) for x in [*blk[k], *own[k]]}
        return not (any(u in late for x in self.post for u in x.all_input_nodes)
                    or any(u in own[c] for x in self.pre for u in x.all_input_nodes))

    def _renumber(self, text: str, by: int) -> str:
        m = _LIFTED.search(text)
        return text if m is None or not by else text[:m.start(1)] + str(int(m.group(1)) + by) + text[m.end(1):]

    def _emit(self, x: torch.fx.Node, name: str, args: Any, kwargs: Any, meta: dict) -> torch.fx.Node:
        y = self.g.create_node(x.op, x.target if x.op != "placeholder" else name, args, kwargs, name=name)
        y.meta = meta
        return y

    def _placeholders(self) -> None:
        """Placeholders come grouped by kind (parameters, buffers, constants, inputs), each group in
        the model's order: blocks c+1..n-1 go right after block c's last placeholder of each kind;
        lifted constants after the stack are numbered past the copies'."""
        holders, c, prefix = self.holders, self.c, self.prefix
        shift = (self.n - self.keep) * self.per_block
        kinds = [self.inputs.get(x.name, ("USER_INPUT", None))[0] for x in holders]
        last_of = {kd: max(i for i, x in enumerate(holders) if self.owner(x) == c and kinds[i] == kd)
                   for kd in {kinds[i] for i, x in enumerate(holders) if self.owner(x) == c}}
        lp_s = self.path.replace(".", "_")
        for i, x in enumerate(holders):
            kind, target = self.inputs.get(x.name, ("USER_INPUT", None))
            name = x.name
            if self.top is not None and self.owner(x) is None and target and (m := _LIFTED.search(target)) \
                    and int(m.group(1)) > self.top:
                name, target = self._renumber(name, shift), self._renumber(target, shift)
            self.new[x] = self._emit(x, name, (), {}, dict(x.meta))
            self.out_inputs[name] = (kind, target)
            if last_of.get(kind) != i:
                continue
            for j, copy in zip(range(self.keep, self.n), self.copies, strict=True):
                for h, kd in zip(holders, kinds, strict=True):
                    if self.owner(h) != c or kd != kind:
                        continue
                    old_s, new_s = f"{lp_s}_{c}_", f"{lp_s}_{j}_"
                    if h.name.count(old_s) != 1:
                        raise _NotFoldable
                    by = (j - c) * self.per_block if isinstance(self.own[c][h], tuple) else 0
                    nm = self._renumber(h.name.replace(old_s, new_s), by)
                    copy[h] = self._emit(h, nm, (), {}, dict(h.meta))
                    tgt = self.inputs[h.name][1]
                    self.out_inputs[nm] = (kd, self._renumber(f"{prefix}{j}." + tgt[len(f"{prefix}{c}."):], by))

    def build(self) -> FoldedProgram:
        """The full model's node sequence: the traced nodes (their names replayed by fx's namer),
        blocks c+1..n-1 copied from block c, then what follows the stack."""
        blk, pos, p, c, remap = self.blk, self.pos, self.p, self.c, torch.fx.node.map_arg
        self.g = torch.fx.Graph()
        self.new: dict[torch.fx.Node, torch.fx.Node] = {}
        self.out_inputs: dict[str, tuple[str, str | None]] = {}
        self.copies: list[dict[torch.fx.Node, torch.fx.Node]] = [{} for _ in range(self.keep, self.n)]
        self._placeholders()
        new = self.new
        for x in [*self.pre, *(x for b in blk for x in b)]:
            y = self._emit(x, _base(x.name), remap(x.args, new.__getitem__), remap(x.kwargs, new.__getitem__),
                           dict(x.meta))
            if y.name != x.name:  # fx's namer does not replay this export's names: trust nothing
                raise _NotFoldable
            new[x] = y
        prev = {x: new[x] for x in blk[c]}  # block j-1's nodes, by block c's node
        old = f"{self.prefix}{c}"
        for j, params in zip(range(self.keep, self.n), self.copies, strict=True):
            cur: dict[torch.fx.Node, torch.fx.Node] = {}

            def table(a: torch.fx.Node, cur=cur, prev=prev, params=params) -> torch.fx.Node:
                if a in pos[c]:
                    return cur[a]
                if a in pos[p]:  # block c read block p: the copy reads its predecessor
                    return prev[blk[c][pos[p][a]]]
                return params[a] if a in params else new[a]

            for x in blk[c]:
                meta = dict(x.meta)
                if "nn_module_stack" in meta:
                    meta["nn_module_stack"] = {k: (_retarget(mp, old, f"{self.prefix}{j}"), t)
                                               for k, (mp, t) in meta["nn_module_stack"].items()}
                cur[x] = self._emit(x, _base(x.name), remap(x.args, table), remap(x.kwargs, table), meta)
            prev = cur
        last = prev

        def tail(a: torch.fx.Node) -> torch.fx.Node:
            if a in self.own[c]:
                return self.copies[-1][a] if self.copies else new[a]
            return last[a] if a in pos[c] else new[a]

        for x in self.post:
            new[x] = self._emit(x, _base(x.name) if x.op != "output" else "output", remap(x.args, tail),
                                remap(x.kwargs, tail), dict(x.meta))
        outputs = tuple(o.kind.name for o in self.ep.graph_signature.output_specs)
        return FoldedProgram(self.g, self.out_inputs, self.ep.graph_module, outputs,
                             single=self.ep.call_spec.out_spec.is_leaf())


class _NotFoldable(Exception):
    pass


def _shapes(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    if isinstance(v, list | tuple):
        return tuple(_shapes(x) for x in v)
    return repr(v) if v is not None else None
