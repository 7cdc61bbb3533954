"""Timing the user's model on this machine as the torch backend runs it: what a profiled search prices.

The measurements :func:`polyparallel.cost_models.profile_fit.build_profile` fits (its docstring
says how): each node's forward and backward in eager training steps at several micro-batch sizes
(:func:`measure_nodes`), the optimizer step (:func:`measure_optimizer`), what the backend's FSDP2
wrapping and DTensor's dispatch add on one rank (:func:`measure_wrappers`), and how much slower a step runs while other
processes share the machine (:func:`contention`). Every measurement runs as a rank does: one
thread, subnormals flushed (``_entry.py``), on a copy of the model (the user's stays untouched).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from polyparallel.cost_models.calibrate import fit_alpha_beta
from polyparallel.cost_models.machine_load import STOLEN, cpu_clock, stolen_since
from polyparallel.cost_models.op_profile import OpProfile, with_profile
from polyparallel.cost_models.profile_fit import build_profile
from polyparallel.ir import Graph
from polyparallel.planning.model_graphs import rebatch

__all__ = ["NodeTimer", "contention", "measure_collectives", "measure_nodes", "measure_optimizer", "measure_wrappers",
           "profile_model", "profiled_cluster"]


def _optimizer(name: str, params: Any) -> Any:
    """The backend's optimizer ``name`` for a CPU process (``_steps.make_optimizer``), at a learning
    rate too small to change what is measured. Imported here: this module loads with the planner,
    which must not load torch.distributed at import."""
    import torch

    from polyparallel.backends.torch._steps import make_optimizer  # loads torch: import polyparallel loads op_timing

    return make_optimizer(name, params, 1e-6, torch.device("cpu"))


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


class NodeTimer:
    """Times the nodes of ``model``'s exported graph in eager training steps (exported once).

    :meth:`run` gives the median seconds ``[(node, forward, backward), ...]`` of each call of the
    graph, in execution order, over ``steps`` forward + backward passes on this thread, and the
    plain step's medians ``{"forward", "backward", "adam"}``: the module itself, no instrumentation,
    stepping Adam between passes as training does (which the node times are later scaled to)."""

    def __init__(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        from polyparallel.frontends.torch import _export_program

        self.model = copy.deepcopy(model)
        self.model.train()
        self.args, self.kwargs = args, kwargs
        self.gm = _export_program(self.model, args, kwargs).module()

    def run(self, steps: int = 12, warmup: int = 2) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
        import torch

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
                # a composite op (linear: view, addmm, view) has several autograd nodes; its output's
                # is the last created, so the engine starts the op's backward there and runs the rest
                # of it (and the gradient accumulation of its parameters) before any earlier op's
                first = next((t for t in torch.utils._pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
                if first is not None:
                    first.grad_fn.register_prehook(mark(n.name))
                return out

        flat = torch.utils._pytree.tree_leaves((self.args, self.kwargs))
        for i in range(warmup + steps):
            self.gm.zero_grad(set_to_none=True)
            marks.clear()
            out = Timed(self.gm).run(*flat)
            _scalar_loss(out).backward()
            end = time.perf_counter()
            if i < warmup:
                fwd.clear()
                order.clear()
                continue
            # a node's backward lasts from its start to the next node's (the engine runs one at a time)
            got: dict[str, float] = {}
            for (t, name), nxt in zip(marks, [*marks[1:], (end, "")], strict=True):
                got[name] = got.get(name, 0.0) + nxt[0] - t
            for name, t in got.items():
                bwd.setdefault(name, []).append(t)
        f, b, o = _plain_step(self.model, self.args, self.kwargs, "adam", steps, warmup)
        rows = [(n, statistics.median(fwd[n]), statistics.median(bwd[n]) if n in bwd else 0.0) for n in order]
        return rows, {"forward": f, "backward": b, "adam": o}


def measure_nodes(model: Any, args: tuple, kwargs: dict[str, Any], *, steps: int = 12,
                  warmup: int = 2) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """:meth:`NodeTimer.run` of a fresh timer: per-node and plain-step seconds of ``model``."""
    return NodeTimer(model, args, kwargs).run(steps, warmup)


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
        try:
            opt = _optimizer(name, [p for p in model.parameters() if p.requires_grad])
        except KeyError:  # not one the backend makes
            continue
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
    opt = _optimizer(optimizer, model.parameters())
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


def measure_wrappers(model: Any, args: tuple, kwargs: dict[str, Any], optimizers: Sequence[str], *,
                     steps: int = 10) -> dict[str, tuple[float, float, float]]:
    """What the backend's parallel wrappers add to one process's work, without any communication:
    ``(forward, backward, optimizer)`` seconds by key.

    - ``zero<k>/<optimizer>``: FSDP2 wrapped as the torch backend wraps the model (its hooks,
      copies and DTensor optimizer step), ZeRO 2 (weights kept gathered from forward to backward)
      and 3 (gathered again for the backward), against the same steps unwrapped;
    - ``cross_rank_norm/op``: per BatchNorm in training mode, what computing its statistics op by op
      over the replicas (``_batchnorm.py``, its collectives on one rank) adds over the fused kernel;
    - ``tp/op``: one linear layer with DTensor weights (a column-parallel and a row-parallel pair,
      as Megatron pairs them, halved) against plain ones: DTensor's dispatch per sharded op, which
      a small layer's kernels do not hide.

    A one-rank gloo group runs them; empty when this process already has a process group (it is
    not ours to replace)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from polyparallel.backends.torch._batchnorm import has_batch_statistics, use_cross_rank_batchnorm
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
            x = torch.randn(8, 64)

            def pair() -> torch.nn.Module:
                return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))

            m = copy.deepcopy(model)
            try:  # as for 2 ranks (a world of 1 leaves BatchNorm alone), over this 1-rank group
                n = use_cross_rank_batchnorm(m, dist.group.WORLD, 2) if has_batch_statistics(model) else 0
            except ValueError:  # a BatchNorm of its own the backend refuses to make cross-rank
                n = 0
            if n:
                f1, b1, _ = _plain_step(m, args, kwargs, "sgd", steps)
                f0, b0, _ = _plain_step(copy.deepcopy(model), args, kwargs, "sgd", steps)
                out["cross_rank_norm/op"] = (max(0.0, f1 - f0) / n, max(0.0, b1 - b0) / n, 0.0)
            tp = parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
            f0, b0, _ = _plain_step(pair(), (x,), {}, "sgd", 4 * steps)
            f1, b1, _ = _plain_step(tp, (x,), {}, "sgd", 4 * steps)
            out["tp/op"] = (max(0.0, f1 - f0) / 2, max(0.0, b1 - b0) / 2, 0.0)
        finally:
            dist.destroy_process_group()
    return out


def _background(model: Any, args: tuple, kwargs: dict[str, Any], stop: Any) -> None:
    """A competing process: the same eager training steps until ``stop`` is set."""
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model = copy.deepcopy(model)
    opt = _optimizer("adam", model.parameters())
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
    m = copy.deepcopy(model)

    def step_time() -> float:
        return sum(_plain_step(m, args, kwargs, "adam", steps))

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


def profile_model(model: Any, args: tuple, kwargs: dict[str, Any], graphs: Callable[[int], Graph],
                  rebatch: Callable[[Any, int], Any], cluster: Any, worlds: Sequence[int],
                  optimizers: Sequence[str] = ("sgd", "adam", "adamw"), batches: Sequence[int] = (1, 2, 4, 8),
                  rounds: int = 3, say: Callable[[str], None] = lambda _: None) -> OpProfile:
    """Measure ``model`` on this machine (module docstring) and build its ops' curves.

    Args:
        graphs: the priced graph at a micro-batch size (``ModelGraphs.graph``).
        rebatch: ``rebatch(value, b)``: an example input at micro-batch ``b``.
        cluster: the calibrated ``local-cpu`` cluster whose device roofline the curves are drawn against.
        worlds: the process counts a plan may use (contention is measured for each).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs
    torch.set_flush_denormal(True)  # as a rank runs (backends/torch/_entry.py)
    try:
        inputs = {b: (tuple(rebatch(x, b) for x in args), {k: rebatch(v, b) for k, v in kwargs.items()})
                  for b in batches}
        timers = {b: NodeTimer(model, *inputs[b]) for b in batches}
        runs: dict[int, list[tuple[list[tuple[str, float, float]], dict[str, float]]]] = {b: [] for b in batches}
        kappas: list[dict[int, float]] = []
        # a shared machine's speed drifts by 10-20% over tens of seconds: every measurement is taken in
        # `rounds` rounds, spread over the profile's whole duration, and the median of the rounds kept
        for r in range(rounds):
            say(f"profiling the model's ops: round {r + 1}/{rounds}")
            for b in batches:
                runs[b].append(timers[b].run())
            # at a middle batch: the slowdown grows with the working set (~1.0 at batch 2, ~1.25 at
            # batch 4 for two processes of the executor benchmark's GPT)
            kappas.append(contention(model, *inputs[batches[len(batches) // 2]], worlds))
        nodes = {b: _median_run(rs) for b, rs in runs.items()}
        kappa = {w: statistics.median(k[w] for k in kappas) for w in kappas[0]}
        say("measuring the optimizer step and what the parallel wrappers add")
        tight = measure_optimizer(model, [*optimizers, "adam"])
        # the optimizer as it runs between training passes (caches holding activations, not its state)
        in_loop = statistics.median(p["adam"] for rs in runs.values() for _, p in rs) / tight["adam"]
        opt_measured = {o: tight[o] * in_loop for o in optimizers}
        wrappers = measure_wrappers(model, *inputs[batches[0]], optimizers) if max(worlds) > 1 else {}
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    return build_profile(graphs, cluster, nodes, opt_measured, kappa, wrappers)


def _collective_rank(rank: int, world: int, store: str, model: Any, args: tuple, kwargs: dict[str, Any],
                     sizes: Sequence[int], steps: int, out: Any) -> None:
    """One rank of :func:`measure_collectives`: a training pass, then an all-reduce, repeatedly."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        m = copy.deepcopy(model)
        got = {}
        for n in sizes:
            buf = torch.zeros(max(1, n // 4))
            ts = []
            for i in range(steps + 2):
                m.zero_grad(set_to_none=True)
                _scalar_loss(m(*args, **kwargs)).backward()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                if i >= 2:
                    ts.append(time.perf_counter() - t0)
            got[n] = statistics.median(ts)
        if rank == 0:
            out.put(got)
    finally:
        dist.destroy_process_group()


def measure_collectives(model: Any, args: tuple, kwargs: dict[str, Any], world: int, *,
                        sizes: Sequence[int] = (4096, 1 << 18, 1 << 21), steps: int = 8,
                        max_bandwidth: float | None = None) -> dict[str, float]:
    """Gloo's all-reduce as a training step meets it: ``world`` forked processes each run a forward
    and backward of the model, then all-reduce, repeatedly; the ring ``α``/bandwidth fitted to rank 0's
    median times (:func:`polyparallel.cost_models.calibrate.fit_alpha_beta`).

    Back-to-back collectives of idle processes (what ``calibrate`` times) find gloo's threads awake
    and the peers in step: ~0.16 ms per small all-reduce here, where one issued after a training
    pass took ~0.8 ms (waking the threads, the peers' drift apart).

    ``max_bandwidth``: the link's bandwidth between idle processes (the calibration's), which a
    collective between training passes does not exceed; where the fit says more (more processes
    than cores: every size took about as long, so the fit found no slope), the bandwidth is that and
    ``α`` alone is fitted."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_collective_rank, daemon=True,
                             args=(r, world, f"{d}/store", model, args, kwargs, sizes, steps, q)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = q.get(timeout=120)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    points = [(world, n, t) for n, t in got.items()]
    fit = fit_alpha_beta(points)
    if max_bandwidth is not None and fit["bandwidth"] > max_bandwidth:
        fit = fit_alpha_beta(points, bandwidth=max_bandwidth)
    return fit


def _median_run(runs: list[tuple[list[tuple[str, float, float]], dict[str, float]]]
                ) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """Per node and per plain-step part, the median over rounds of :meth:`NodeTimer.run` results."""
    rows = [(name, statistics.median(r[0][i][1] for r in runs), statistics.median(r[0][i][2] for r in runs))
            for i, (name, _, _) in enumerate(runs[0][0])]
    return rows, {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}


def profiled_cluster(cluster: Any, graphs: Any, say: Callable[[str], None] = lambda _: None) -> Any:
    """``cluster`` (a calibrated ``local-cpu:<P>``) with its device type carrying the profile of the
    module ``graphs`` (a :class:`~polyparallel.planning.model_graphs.ModelGraphs`) holds."""
    dt = cluster.device(0).type
    if not cluster.name.startswith("local-cpu:") or dt.kind != "cpu" or not getattr(graphs, "resizable", False):
        raise ValueError("profiling measures the model's ops on this machine: it needs a torch module (not an "
                         f"ONNX file or a graph) and a local-cpu:<P> cluster, not {cluster.name}")
    if cluster.calibration is None:
        raise ValueError("profiling fits the model's ops to this machine's calibration: run `polyparallel "
                         "calibrate` first")

    b0 = graphs.b0
    clock = cpu_clock()
    prof = profile_model(graphs.model, graphs.args, graphs.kwargs, graphs.graph, lambda v, b: rebatch(v, b0, b),
                         cluster, range(1, cluster.num_devices + 1), say=say)
    link = None
    if cluster.num_devices > 1:
        say("measuring gloo's all-reduce between training passes")
        fit = measure_collectives(graphs.model, tuple(rebatch(x, b0, 2) for x in graphs.args),
                                  {k: rebatch(v, b0, 2) for k, v in graphs.kwargs.items()}, cluster.num_devices,
                                  max_bandwidth=cluster.nodes[0].intra.up if cluster.nodes[0].intra else None)
        link = (fit["alpha"], fit["bandwidth"])
    steal = stolen_since(clock)
    if steal > STOLEN:  # the prices are slower and noisier than this machine: say so where they are shown
        prof = replace(prof, source=f"{prof.source}; WARNING: the hypervisor took {100 * steal:.0f}% of the CPU "
                                    "time while profiling (other virtual machines): profile again when it is quiet")
    return with_profile(cluster, prof, link)


