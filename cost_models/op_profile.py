"""Measured op times of the user's model on this machine: the prices of a profiled CPU search.

A calibration measures kernels one by one, each on operands that stay in cache, and a CPU
training step does not run at those rates: its ops read what the previous op wrote, its
weights and optimizer state stream from memory, and a second process on the other core slows
both (the executor benchmark priced a small GPT's eager step 35-50% too fast from such rates).
Profiling-based planners (Alpa, Galvatron, nnScaler) measure the model's own layers instead;
this module does that for a module searched on ``local-cpu:<P>``.

:func:`measure_nodes` runs eager training steps of the model's exported graph (the same aten
ops the user's module dispatches) through an fx interpreter that times each node's forward and
marks, by a pre-hook on its autograd function, when the engine starts its backward: on a CPU
the engine runs one autograd function at a time, so a node's backward lasts until the next
node's starts. :func:`profile_model` does so at
two micro-batch sizes, with ``W - 1`` other processes running the same steps for each world
size ``W`` of the cluster (they share the cores, caches and memory bus as a ``W``-rank job's
ranks do), and fits every op of the priced graph as ``t = a + c·r``: ``r`` is the op's roofline
price (:func:`polyparallel.cost_models.compute.op_cost`, eager), ``a`` what the op costs
whatever its size (dispatch, autograd), ``c`` how much slower than the roofline its work runs in
a real step. A tensor- or sequence-parallel shard, or another micro-batch, is priced from its
own roofline through the same line. The nodes a priced op absorbed (views, elementwise ops fused
into their producer) are charged to it; the step's time outside any node (autograd's gradient
accumulation, the loss's backward call) is spread over the ops in proportion, so the profiled
step adds up to the measured one. The optimizer step is measured whole and scales its priced
term.

The profile belongs to one model (:func:`fingerprint` of the priced graph) and one machine; the
device type carries it (``DeviceType.op_profile``), so a graph it was not measured on is priced
from the calibration alone.
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from polyparallel.ir import Graph, TensorKind

__all__ = ["OpProfile", "contention", "fingerprint", "measure_fsdp", "measure_nodes", "measure_optimizer",
           "profile_model", "profiled_cluster", "profiled_op", "with_profile"]


@dataclass(frozen=True)
class OpProfile:
    """Fitted op prices of one model on one machine, by world size.

    Attributes:
        fingerprint: of the graph the ops were measured on (:func:`fingerprint`).
        lines: ``(world, ((op name, a_fwd, c_fwd, a_bwd, c_bwd), ...))``: ``t = a + c·roofline``.
        optimizer: ``(world, ((optimizer, measured / priced), ...))`` of the whole step.
        batches: the micro-batch sizes measured.
        source: how and when it was measured.
        wrappers: ``(world, ((key, forward, backward, optimizer), ...))``: seconds a data-parallel
            wrapper adds to a step whatever it communicates (:func:`measure_fsdp`'s keys).
    """

    fingerprint: str
    lines: tuple[tuple[int, tuple[tuple[str, float, float, float, float], ...]], ...]
    optimizer: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    batches: tuple[int, ...]
    source: str = ""
    wrappers: tuple[tuple[int, tuple[tuple[str, float, float, float], ...]], ...] = ()

    def matches(self, graph: Graph) -> bool:
        """Whether ``graph`` is (a re-batching of) the graph this profile measured."""
        return _fingerprint_of(graph) == self.fingerprint

    def _world(self, world: int) -> int:
        have = [w for w, _ in self.lines]
        return min(have, key=lambda w: (abs(w - world), -w))

    @cached_property
    def _tables(self) -> dict[str, dict[int, dict[str, tuple[float, ...]]]]:
        """The tuples as lookups: ``{"lines"|"wrappers": {world: {name: values}}}``, built once."""
        return {"lines": {w: {n: tuple(v) for n, *v in rows} for w, rows in self.lines},
                "wrappers": {w: {k: tuple(v) for k, *v in rows} for w, rows in self.wrappers}}

    def line(self, world: int, op: str) -> tuple[float, ...] | None:
        """``(a_fwd, c_fwd, a_bwd, c_bwd)`` of ``op`` at the measured world size nearest ``world``."""
        return self._tables["lines"].get(self._world(world), {}).get(op)

    def wrapper(self, world: int, key: str) -> tuple[float, ...] | None:
        """``(forward, backward, optimizer)`` seconds the wrapper ``key`` adds, at the measured world
        size nearest ``world``."""
        return self._tables["wrappers"].get(self._world(world), {}).get(key)

    def optimizer_ratio(self, world: int, optimizer: str) -> float | None:
        """Measured over priced seconds of the model's ``optimizer`` step at the world size nearest ``world``."""
        return dict(dict(self.optimizer).get(self._world(world), ())).get(optimizer)


def fingerprint(graph: Graph) -> str:
    """What identifies a model's graph whatever its batch: op names and targets, parameter shapes."""
    h = hashlib.sha1()
    for op in graph.ops:
        h.update(f"{op.name}|{op.target}|{op.source_node};".encode())
    for name, spec in graph.tensors.items():
        if spec.kind is TensorKind.PARAM:
            h.update(f"{name}{tuple(spec.shape)};".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------

def _scalar_loss(out: Any) -> Any:
    """The training loss of a model's output: the tensor itself, a ``loss`` field, or the sum of
    the first floating-point tensor (what a backward from the output needs)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    loss = getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor to train on")
    return leaves[0].float().sum()


def measure_nodes(model: Any, args: tuple, kwargs: dict[str, Any], *, steps: int = 12,
                  warmup: int = 2) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """Median seconds ``[(node, forward, backward), ...]`` of each call of the model's exported
    graph, in execution order, over ``steps`` eager forward + backward passes on this thread;
    and the plain step's medians ``{"forward", "backward"}`` (the module itself, no
    instrumentation), which the node times are later scaled to."""
    import torch

    from polyparallel.frontends.torch import _export_program

    model = copy.deepcopy(model)
    model.train()
    gm = _export_program(model, args, kwargs).module()
    fwd: dict[str, list[float]] = {}
    bwd: dict[str, list[float]] = {}
    order: list[str] = []
    marks: list[tuple[float, str]] = []  # when each node's backward began, in the engine's order

    def mark(name: str) -> Callable[[Any], None]:
        def pre(grad_outputs: Any) -> None:
            marks.append((time.perf_counter(), name))
        return pre

    class Timed(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            a, kw = self.fetch_args_kwargs_from_env(n)
            t0 = time.perf_counter()
            out = n.target(*a, **kw)
            fwd.setdefault(n.name, []).append(time.perf_counter() - t0)
            if len(fwd[n.name]) == 1:
                order.append(n.name)
            # a composite op (linear: view, addmm, view) has several autograd nodes; its output's is
            # the last created, so the engine starts the op's backward there and runs the rest of it
            # (and the gradient accumulation of its parameters) before any earlier op's
            first = next((t for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
            if first is not None:
                first.grad_fn.register_prehook(mark(n.name))
            return out

    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    for i in range(warmup + steps):
        gm.zero_grad(set_to_none=True)
        marks.clear()
        out = Timed(gm).run(*flat)
        _scalar_loss(out).backward()
        end = time.perf_counter()
        if i < warmup:
            fwd.clear()
            order.clear()
            continue
        # each node's backward: from its start to the next node's start (the engine runs one node at a time)
        got: dict[str, float] = {}
        for (t, name), nxt in zip(marks, [*marks[1:], (end, "")], strict=True):
            got[name] = got.get(name, 0.0) + nxt[0] - t
        for name, t in got.items():
            bwd.setdefault(name, []).append(t)
    plain_f, plain_b = [], []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = _scalar_loss(model(*args, **kwargs))
        t1 = time.perf_counter()
        loss.backward()
        if i >= warmup:
            plain_f.append(t1 - t0)
            plain_b.append(time.perf_counter() - t1)
    rows = [(n, statistics.median(fwd[n]), statistics.median(bwd[n]) if n in bwd else 0.0) for n in order]
    return rows, {"forward": statistics.median(plain_f), "backward": statistics.median(plain_b)}


def measure_optimizer(model: Any, optimizers: Sequence[str], *, steps: int = 12,
                      warmup: int = 2) -> dict[str, float]:
    """Median seconds of one optimizer step over the model's parameters (gradients set), per name."""
    import torch

    model = copy.deepcopy(model)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name in optimizers:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(name)
        if cls is None:
            continue
        opt = cls([p for p in model.parameters() if p.requires_grad], lr=1e-6)
        ts = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.step()
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    return out


def _plain_step(model: Any, args: tuple, kwargs: dict[str, Any], optimizer: str, steps: int,
                warmup: int = 2) -> tuple[float, float, float]:
    """Median seconds of forward, backward and optimizer step of eager training steps of ``model``."""
    import torch

    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer]
    opt = cls(model.parameters(), lr=1e-6)
    ts = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = _scalar_loss(model(*args, **kwargs))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if i >= warmup:
            ts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return tuple(statistics.median(c) for c in zip(*ts, strict=True))  # type: ignore[return-value]


def measure_fsdp(model: Any, args: tuple, kwargs: dict[str, Any], optimizers: Sequence[str], *,
                 steps: int = 10) -> dict[str, tuple[float, float, float]]:
    """What FSDP2, wrapped as the torch backend wraps it, adds to one process's step, without any
    communication: ``{"zero<k>/<optimizer>": (forward, backward, optimizer) seconds}``, for ZeRO 2
    (weights kept gathered from forward to backward) and 3 (gathered again for the backward).

    A one-rank gloo group runs the wrapper's hooks, copies and DTensor optimizer step; empty when
    this process already has a process group (it is not ours to replace)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from polyparallel.backends.torch._worker import _fully_shard

    if dist.is_initialized():
        return {}
    out: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            for o in optimizers:
                plain = _plain_step(copy.deepcopy(model), args, kwargs, o, steps)
                for stage in (2, 3):
                    m = copy.deepcopy(model)
                    _fully_shard(m, mesh, stage, {})
                    wrapped = _plain_step(m, args, kwargs, o, steps)
                    out[f"zero{stage}/{o}"] = tuple(max(0.0, w - p) for w, p in zip(wrapped, plain, strict=True))
        finally:
            dist.destroy_process_group()
    return out


def _background(model: Any, args: tuple, kwargs: dict[str, Any], stop: Any) -> None:
    """A competing process: the same eager training steps until ``stop`` is set."""
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    while not stop.is_set():
        opt.zero_grad(set_to_none=True)
        _scalar_loss(model(*args, **kwargs)).backward()
        opt.step()


def _with_load(others: int, model: Any, args: tuple, kwargs: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """``fn()`` while ``others`` forked processes run the model's training steps."""
    if others <= 0:
        return fn()
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_background, args=(model, args, kwargs, stop), daemon=True) for _ in range(others)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.3)  # they are past their first step
        return fn()
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def contention(model: Any, args: tuple, kwargs: dict[str, Any], worlds: Sequence[int], *,
               steps: int = 12) -> dict[int, float]:
    """How much slower the model's plain training step runs in this process while ``W - 1``
    other processes run it too, for each ``W`` in ``worlds`` (1.0 for ``W = 1``): the ranks of a
    ``W``-process job on this machine share its cores, caches and memory bus."""
    import torch

    m = copy.deepcopy(model)
    opt = torch.optim.Adam(m.parameters(), lr=1e-6)

    def step_time() -> float:
        ts = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _scalar_loss(m(*args, **kwargs)).backward()
            opt.step()
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out = {}
    before = step_time()
    for w in sorted(set(worlds)):
        if w <= 1:
            out[w] = 1.0
            continue
        loaded = _with_load(w - 1, model, args, kwargs, step_time)
        after = step_time()  # against the machine alone just before and after: other work drifts
        out[w] = max(1.0, loaded / ((before + after) / 2))
        before = after
    return out


def _attribute(rows: list[tuple[str, float, float]], graph: Graph) -> dict[str, tuple[float, float]]:
    """Node times summed per priced op: a node the graph has no op for (a view, an elementwise op
    fused into its producer) is charged to the op before it, or the first op if none is."""
    by_node = {op.source_node or op.name: op.name for op in graph.ops}
    first = next((by_node[n] for n, _, _ in rows if n in by_node), graph.ops[0].name if graph.ops else "")
    out: dict[str, list[float]] = {}
    current = first
    for node, f, b in rows:
        current = by_node.get(node, current)
        acc = out.setdefault(current, [0.0, 0.0])
        acc[0] += f
        acc[1] += b
    return {k: (v[0], v[1]) for k, v in out.items()}


def _fit(t1: float, r1: float, t2: float, r2: float) -> tuple[float, float]:
    """``(a, c)`` of ``t = a + c·r`` through two measurements; ``a, c ≥ 0``. Where the roofline does not
    grow between them (a batch-independent op) or the line would need a negative part, the ratio."""
    if r1 <= 0 and r2 <= 0:
        return (t1 + t2) / 2, 0.0
    if r2 > 1.05 * r1 > 0:
        c = (t2 - t1) / (r2 - r1)
        a = t1 - c * r1
        if c > 0 and a >= 0:
            return a, c
    return 0.0, (t1 + t2) / (r1 + r2)


def profile_model(model: Any, args: tuple, kwargs: dict[str, Any], graphs: Callable[[int], Graph],
                  rebatch: Callable[[Any, int], Any], cluster: Any, worlds: Sequence[int],
                  optimizers: Sequence[str] = ("sgd", "adam", "adamw"), batches: Sequence[int] = (2, 4),
                  say: Callable[[str], None] = lambda _: None) -> OpProfile:
    """Measure ``model`` on this machine (module docstring) and fit its ops' lines.

    Args:
        graphs: the priced graph at a micro-batch size (``ModelGraphs.graph``).
        rebatch: ``rebatch(value, b)``: an example input at micro-batch ``b``.
        cluster: the calibrated ``local-cpu`` cluster whose device roofline the lines are fitted to.
        worlds: the process counts a plan may use (contention is measured for each).
    """
    import torch

    from polyparallel.cost_models.compute import op_cost

    device = cluster.device(0).type
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs
    torch.set_flush_denormal(True)  # as a rank runs (backends/torch/_entry.py)
    try:
        measured: dict[int, dict[str, tuple[float, float]]] = {}
        roof: dict[int, dict[str, tuple[float, float]]] = {}
        for b in batches:
            say(f"profiling the model's ops at micro-batch {b}")
            a_b = tuple(rebatch(x, b) for x in args)
            k_b = {k: rebatch(v, b) for k, v in kwargs.items()}
            rows, plain = measure_nodes(model, a_b, k_b)
            g = graphs(b)
            per_op = _attribute(rows, g)
            # scale to the plain step: what no node's interval holds (the hooks' own time, the
            # engine's start) is spread over the ops in proportion
            sf = plain["forward"] / max(sum(f for f, _ in per_op.values()), 1e-12)
            sb = plain["backward"] / max(sum(b_ for _, b_ in per_op.values()), 1e-12)
            measured[b] = {k: (f * sf, bw * sb) for k, (f, bw) in per_op.items()}
            roof[b] = {}
            for op in g.ops:
                c = op_cost(g, op, device, eager=True)
                roof[b][op.name] = (c.forward, c.backward)
        say("measuring the optimizer step and the cost of sharing the machine")
        opt_measured = measure_optimizer(model, optimizers)
        a0, k0 = tuple(rebatch(x, batches[0]) for x in args), {k: rebatch(v, batches[0]) for k, v in kwargs.items()}
        kappa = contention(model, a0, k0, worlds)
        wrappers = measure_fsdp(model, a0, k0, optimizers) if max(worlds) > 1 else {}
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    b1, b2 = batches[0], batches[-1]
    base = []
    for name in roof[b1]:
        t1, t2 = measured[b1].get(name, (0.0, 0.0)), measured[b2].get(name, (0.0, 0.0))
        r1, r2 = roof[b1][name], roof[b2].get(name, roof[b1][name])
        base.append((name, *_fit(t1[0], r1[0], t2[0], r2[0]), *_fit(t1[1], r1[1], t2[1], r2[1])))
    opt_priced = _priced_optimizer(graphs(b1), cluster, optimizers)
    lines, opt, wraps = [], [], []
    for w, k in sorted(kappa.items()):
        lines.append((w, tuple((n, af * k, cf * k, ab * k, cb * k) for n, af, cf, ab, cb in base)))
        opt.append((w, tuple((o, k * t / opt_priced[o]) for o, t in opt_measured.items() if opt_priced.get(o))))
        wraps.append((w, tuple((key, *(k * x for x in v)) for key, v in sorted(wrappers.items()))))
    shared = ", ".join(f"{w} procs x{k:.2f}" for w, k in sorted(kappa.items()))
    src = (f"ops profiled on this machine ({time.strftime('%Y-%m-%d %H:%M')}, micro-batches "
           f"{', '.join(map(str, batches))}; sharing it: {shared})")
    return OpProfile(fingerprint(graphs(b1)), tuple(lines), tuple(opt), tuple(batches), src, tuple(wraps))


def _priced_optimizer(graph: Graph, cluster: Any, optimizers: Sequence[str]) -> dict[str, float]:
    """The calibration's price of one single-process optimizer step, per optimizer."""
    from polyparallel.cost_models import ParallelConfig, estimate_step

    return {o: estimate_step(graph, cluster, ParallelConfig(optimizer=o)).breakdown()["optimizer"] for o in optimizers}


def profiled_cluster(cluster: Any, graphs: Any, say: Callable[[str], None] = lambda _: None) -> Any:
    """``cluster`` (a calibrated ``local-cpu:<P>``) with its device type carrying the profile of the
    module ``graphs`` (a :class:`~polyparallel.planning.model_graphs.ModelGraphs`) holds."""
    from polyparallel.planning.model_graphs import rebatch

    dt = cluster.device(0).type
    if not cluster.name.startswith("local-cpu:") or dt.kind != "cpu" or not getattr(graphs, "resizable", False):
        raise ValueError("profiling measures the model's ops on this machine: it needs a torch module (not an "
                         f"ONNX file or a graph) and a local-cpu:<P> cluster, not {cluster.name}")
    if cluster.calibration is None:
        raise ValueError("profiling fits the model's ops to this machine's calibration: run `polyparallel "
                         "calibrate` first")
    b0 = graphs.b0
    prof = profile_model(graphs.model, graphs.args, graphs.kwargs, graphs.graph, lambda v, b: rebatch(v, b0, b),
                         cluster, range(1, cluster.num_devices + 1), say=say)
    return with_profile(cluster, prof)


def with_profile(cluster: Any, prof: OpProfile) -> Any:
    """``cluster`` with its (first) device type carrying ``prof``, its source saying so."""
    from dataclasses import replace

    dt = cluster.device(0).type
    new = replace(dt, op_profile=prof, source=f"{dt.source}; {prof.source}")
    nodes = tuple(replace(n, device_type=new) if n.device_type is dt else n for n in cluster.nodes)
    return replace(cluster, nodes=nodes,
                   devices=tuple(replace(d, type=new) if d.type is dt else d for d in cluster.devices),
                   device_types={**cluster.device_types, dt.name: new})


def profiled_op(graph: Graph, op: Any, device: Any, world: int, split: float, sharded: bool,
                dtype: str) -> tuple[float, float] | None:
    """Forward and backward seconds of ``op`` from the device's profile, ``None`` where it has none
    for this graph (another model) or this op."""
    from polyparallel.cost_models.compute import op_cost

    prof: OpProfile | None = device.op_profile
    if prof is None or dtype != "fp32" or not prof.matches(graph):
        return None
    line = prof.line(world, op.name)
    if line is None:
        return None
    a_f, c_f, a_b, c_b = line
    r = op_cost(graph, op, device, dtype, split=split, eager=True)
    fwd, bwd = a_f + c_f * r.forward, a_b + c_b * r.backward
    if sharded:  # a DTensor's dispatch is the host's, not the kernel's: added as the calibration measured it
        s = op_cost(graph, op, device, dtype, split=split, eager=True, sharded=True)
        fwd, bwd = fwd + s.forward - r.forward, bwd + s.backward - r.backward
    return fwd, bwd


def _fingerprint_of(graph: Graph) -> str:
    from polyparallel.cost_models.memo import PRICES

    memo = PRICES.of(graph)
    if "fingerprint" not in memo:
        memo["fingerprint"] = fingerprint(graph)
    return memo["fingerprint"]
