"""A center with several devices runs its own synchronous plan: DDP, FSDP2 or tensor parallelism.

A torch center with ``devices = P > 1`` executes a plan over its devices: the degrees ``dp``, ``tp``
(and ``zero_stage``, ``placements``) it is given — by the collaborative Strategy's per-center
``local_strategy`` (``config_from_strategy``) or explicitly (``CenterSpec(devices=2, plan={"tp": 2})``);
without one, ``dp = P``. :func:`center_exec_plan` prices that recipe for the center's model with the
planner (:func:`polyparallel.evaluate` on ``local-cpu:P``, Megatron placements by default) and
turns the Strategy into the torch backend's :class:`~polyparallel.backends.torch.ExecPlan` with its
own ``plan_for``, so a plan the backend cannot execute exactly is refused here, before round 1, with
the backend's reason. The ``P`` long-lived worker processes (one per device; gloo on CPU) apply it as
the backend's workers do (``_worker._apply``: tensor parallelism on the ``("dp", "sp", "tp")`` mesh,
cross-rank BatchNorm, then DDP or FSDP2 over the ``dp`` axis) and then serve one request per round:
load the global parameters (full tensors, distributed to the plan's DTensor shards by
``set_model_state_dict``), take ``H`` SGD steps, send the full local model back (gathered by
``get_model_state_dict``). Process start-up, the torch import, the rendezvous and the planning are
paid once per center, not once per round.

Equivalence with the single-process :class:`~._center.TorchTrainer`. Round ``t`` draws the same
global batches ``I_1..I_H`` (:func:`~._center.batch_indices`, ``|I_s| = B``); the ranks with
data-parallel coordinate ``r`` take the contiguous share ``I_s[r·B/dp : (r+1)·B/dp]`` (tensor-parallel
peers take the same share). DDP and FSDP2 average gradients over ``dp``, so with equal shares the
step direction is ``(1/dp) Σ_r ∇ (1/(B/dp)) Σ_{i∈share_r} ℓ_i = ∇ (1/B) Σ_{i∈I_s} ℓ_i``, the
single-process gradient; tensor parallelism computes the same function on sharded weights. FedProx's
``mu/2 ||w − x||²`` enters as its gradient ``mu (w − x)``, added to every (reduced) gradient before the
step: the autograd form would mix sharded DTensor parameters into a plain loss. BatchNorm normalises
with the statistics of the *global* batch (:mod:`polyparallel.backends.torch._batchnorm`, as the
backend's data parallelism does). The result equals single-process training up to floating-point
summation order.

Not executed inside a center (refused with the reason): pipeline stages and sequence parallelism
(their step loops are the backend's own, not a center's local SGD), gradient accumulation
(``microbatches > 1``), a precision other than fp32, and what ``plan_for`` refuses for the model.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np

import polyparallel as pp
from polyparallel.backends.torch._procs import free_port
from polyparallel.strategy import op_placements_of
from polyparallel.transforms import canonicalize, fuse_elementwise

from ._center import batch_indices, evaluate_torch, local_sgd
from ._center_plan import normalize_plan
from ._models import ModelSpec, build_torch_model
from ._objective import TorchObjective, label_tensor
from ._rank_center import RankedCenter

__all__ = ["DataParallelTrainer", "PlannedTrainer", "center_exec_plan"]

def _capture_args(objective: Any, x: Any, y: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a local step calls the model (``_objective.TorchObjective``), so the plan prices that call."""
    if objective.own == "labels":
        return (x,), {"labels": y}
    if objective.own == "positional":
        return (x, y), {}
    return (x,), {}


def center_exec_plan(spec: ModelSpec, plan: Mapping[str, Any], x: np.ndarray, y: np.ndarray, batch_size: int,
                     seed: int = 0) -> tuple[Any, Any]:
    """``(Strategy, ExecPlan)`` of a center running ``plan`` (:func:`normalize_plan`'s output) on its
    model, the global batch ``min(batch_size, len(x))``: priced by the planner, checked by the torch
    backend's ``plan_for`` against the model's captured graph.

    A plan the collaborative search wrote carries the per-op placements it priced on the center's
    hardware (``op_placements``): those are run. Otherwise the plan's ``placements`` mode places
    them; without one tensor parallelism is Megatron's, and where the backend cannot execute the
    rule's placements on this model (a norm between two Linears, say) the planner's own per-op
    placements over what the backend executes (``"torch"``). The model's own
    forward runs on each rank's shards (:func:`~polyparallel.backends.torch.own_forward_plan`): a
    plan whose forward does not survive them is refused. Raises ``Unsupported`` (a ValueError) with
    the backend's reason for a plan it cannot run.
    """
    import torch

    from polyparallel.backends.torch._plan import Unsupported, own_forward_plan
    from polyparallel.backends.torch._tensor_parallel import check_fingerprint
    b = min(batch_size, len(x))
    devices = plan["dp"] * plan["tp"]
    if b % plan["dp"]:
        raise ValueError(f"global batch {b} does not split evenly over {plan['dp']} devices (the plan's dp); choose "
                         f"batch_size a multiple of {plan['dp']}")
    model = build_torch_model(spec, seed)
    share = b // plan["dp"]  # the planner captures one replica's batch
    args, kwargs = _capture_args(TorchObjective(model, spec.loss), torch.from_numpy(np.ascontiguousarray(x[:share])),
                                 label_tensor(np.asarray(y[:share]), spec.loss))
    graph = fuse_elementwise(canonicalize(pp.capture(model, args, kwargs)))
    modes = [plan["placements"]] if plan["placements"] else ["rule", "torch"][:1 + (plan["tp"] > 1)]
    refused = []
    for mode in modes:
        s = pp.evaluate(model, args, f"local-cpu:{devices}", example_kwargs=kwargs, dp=plan["dp"], tp=plan["tp"],
                        microbatches=1, zero_stage=plan["zero_stage"], recompute=plan["recompute"], dtype="fp32",
                        batch_size=b, placements=mode)
        check_fingerprint(s, graph)  # the graph plan_for reads is the one the planner priced
        if plan.get("op_placements"):
            s = _as_searched(s, plan["op_placements"], graph)
        try:
            return s, own_forward_plan(s, model, args, kwargs, graph=graph)
        except Unsupported as e:
            refused.append(f"placements={mode!r}: {e}")
    raise Unsupported(" | ".join(refused))


def _as_searched(s: Any, record: Any, graph: Any) -> Any:
    """``s`` with the per-op placements the collaborative search priced on the center's hardware (the
    center's own pricing on ``local-cpu:P`` could place its ops otherwise). Raises ``Unsupported``
    when they name ops or modules this center's capture of the model does not have."""
    from polyparallel.backends.torch._plan import Unsupported

    groups = op_placements_of(record)
    modules = {o.name: o.module or "" for o in graph.ops}
    wrong = [(op, m) for g in groups for op, m in zip(g.ops, g.modules or [""] * len(g.ops))
             if op not in modules or (m and modules[op] != m)]
    if wrong:
        op, m = wrong[0]
        raise Unsupported(f"the plan's per-op placements name op {op!r} (module {m!r}), which this center's capture of "
                          f"the model {'places on module ' + repr(modules[op]) if op in modules else 'does not have'} "
                          f"({len(wrong)} such op(s)): search the collaborative strategy with the model called as the "
                          "center calls it (model(inputs, labels))")
    return s.model_copy(update={"placements": groups})


class _ProximalOptimizer:
    """The round's optimiser with FedProx's gradient ``mu (w − x)`` added to every gradient before
    each step (``x``: the parameters when the round began); DTensor parameters and gradients share
    their placements, so this is shard-local."""

    def __init__(self, opt: Any, params: list[Any], mu: float) -> None:
        self.opt, self.params, self.mu = opt, params, mu
        self.anchors = [p.detach().clone() for p in params] if mu > 0 else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p, a in zip(self.params, self.anchors):
                if p.grad is not None:
                    p.grad.add_(p.detach() - a, alpha=self.mu)
        self.opt.step()


def _full_state(model: Any, params: Mapping[str, np.ndarray], fused: Mapping[str, list[int]]) -> dict[str, Any]:
    """The full state dict to load: the exchanged floating tensors, the local integer buffers
    (BatchNorm's step counts, never exchanged); fused head-parallel projections' rows regrouped as
    their DTensor's global view holds them (``_tensor_parallel.qkv_rows``)."""
    import torch

    out: dict[str, Any] = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            out[k] = v
        elif k not in params:
            raise KeyError(f"parameters missing for the torch model: {k!r}")
        else:
            t = torch.from_numpy(np.ascontiguousarray(params[k], dtype=np.float32))
            rows = fused.get(k.rpartition(".")[0])
            out[k] = t[rows] if rows is not None else t
    return out


def _exchanged(state: Mapping[str, Any], fused: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
    """The gathered full state as the exchanged float32 arrays, fused projections' rows put back."""
    out = {}
    for k, v in state.items():
        if not v.is_floating_point():
            continue
        a = v.detach().cpu().numpy().astype(np.float32, copy=True)
        rows = fused.get(k.rpartition(".")[0])
        out[k] = a[np.argsort(rows)] if rows is not None else a
    return out


def _worker(rank: int, world: int, init_method: str, conn: Any, spec_json: str, plan: Any, x: np.ndarray,
            y: np.ndarray, center: Mapping[str, Any]) -> None:
    """One device of the center: join the group, apply the plan, serve rounds until told to stop."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from polyparallel.backends.torch._tensor_parallel import qkv_rows, step_context
    from polyparallel.backends.torch._worker import _apply

    try:
        torch.set_num_threads(int(center["threads"]))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(center["timeout_s"])))
        spec = ModelSpec.from_json(spec_json)
        model = build_torch_model(spec, int(center["seed"]))
        objective = TorchObjective(model, spec.loss)  # read off the unwrapped module's forward
        net, mesh = _apply(model, {"plan": plan, "batchnorm": "cross_rank"}, torch.device("cpu"), {})
        fused = {path: qkv_rows(seg, plan.tp) for path, seg in plan.fused}
        full = StateDictOptions(full_state_dict=True)
        xt = torch.from_numpy(np.ascontiguousarray(x))
        yt = label_tensor(y, spec.loss)
        conn.send(("ready", rank))
    except BaseException as e:  # the parent reports it; the peers time out of the rendezvous
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    share = min(int(center["batch_size"]), len(x)) // plan.dp
    dp_rank = mesh["dp"].get_local_rank()
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the center process is gone: leave with it
            break
        if msg[0] == "stop":
            break
        try:
            _, params, steps, round_idx, proximal_mu, lr = msg
            set_model_state_dict(model, _full_state(model, params, fused), options=full)
            model.train()
            ps = list(net.parameters())
            opt = _ProximalOptimizer(torch.optim.SGD(ps, lr=lr, momentum=float(center["momentum"])), ps, proximal_mu)
            batches = (idx[dp_rank * share:(dp_rank + 1) * share] for idx in batch_indices(
                len(x), int(center["batch_size"]), steps, int(center["seed"]), int(center["center_index"]), round_idx))
            with step_context(plan, mesh):  # class-parallel loss: forward and backward under loss_parallel
                losses = local_sgd(model, net, opt, xt, yt, batches, 0.0, logit_bias=center["logit_bias"],
                                   objective=objective, weigh=partial(_weigh, mesh["dp"], plan.dp))
            state = get_model_state_dict(model, options=full)  # a collective: every rank gathers
            conn.send(("done", _exchanged(state, fused) if rank == 0 else None, losses))
        except BaseException as e:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
            break
    with contextlib.suppress(Exception):  # a peer already left; nothing to tear down cleanly
        dist.destroy_process_group()


def _weigh(dp: Any, replicas: int, forward: Callable[[], Any]) -> tuple[Any, float]:
    """One step's forward on this rank's share, its loss weighted over the ``dp`` replicas by the
    targets each counted (``_loss_weighting``: padding spread unevenly over the shares), as the
    torch backend's workers weigh theirs: ``(loss to backpropagate, the whole batch's loss)``."""
    import torch

    from polyparallel.backends.torch._loss_weighting import weighed_forward

    loss, whole, _ = weighed_forward(forward, dp.get_group(), replicas, torch.device("cpu"))
    return loss, whole


def _stop(procs: list[Any], conns: list[Any]) -> None:
    for c in conns:
        with contextlib.suppress(OSError, ValueError):  # the worker is already gone
            c.send(("stop",))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


@dataclass
class PlannedTrainer(RankedCenter):
    """Local SGD of one center running ``plan`` over ``devices`` long-lived worker processes (see the
    module docstring); ``plan`` None is data parallelism over every device (DDP).

    The plan is checked and priced when the trainer is made, before any worker starts; ``strategy``
    and ``exec_plan`` hold what the workers run. The global batch ``batch_size`` (or the whole
    center's data when it is smaller) must divide evenly over ``dp``. Call :meth:`close` (or use it as
    a context manager) to stop the workers; they also leave when this process exits.
    """

    plan: Mapping[str, Any] | None = None
    threads: int = 1
    strategy: Any = field(default=None, init=False, repr=False)
    exec_plan: Any = field(default=None, init=False, repr=False)
    _procs: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices < 2:
            raise ValueError(f"a planned center needs devices >= 2, got {self.devices} (use TorchTrainer)")
        where = f"center {self.center_index}"
        plan = normalize_plan(self.plan, self.devices, str(self.center_index))
        try:
            self.strategy, self.exec_plan = center_exec_plan(self.model_spec, plan, self.x, self.y, self.batch_size,
                                                             self.seed)
        except ValueError as e:
            raise type(e)(f"{where} cannot run its plan {plan}: {e}") from e
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # fork after torch threads exist is unsafe; spawn is clean
        init = f"tcp://127.0.0.1:{free_port()}"
        center = {"seed": self.seed, "center_index": self.center_index, "batch_size": self.batch_size,
                  "momentum": self.momentum, "threads": self.threads, "timeout_s": self.timeout_s,
                  "logit_bias": self.logit_bias()}  # from the whole center's labels, as one process would
        for rank in range(self.devices):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"collab-c{self.center_index}-r{rank}", daemon=True,
                            args=(rank, self.devices, init, child, self.model_spec.to_json(), self.exec_plan, self.x,
                                  self.y, center))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        for rank in range(self.devices):
            self._recv(rank, "start")

    def _dead(self, rank: int) -> str | None:
        proc = self._procs[rank]
        return None if proc.is_alive() else f"the worker died (exit code {proc.exitcode})"

    def _round_request(self, params: dict[str, np.ndarray], steps: int, round_idx: int, mu: float) -> tuple:
        return ("round", params, steps, round_idx, mu, self.lr_at(round_idx))

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return evaluate_torch(self.model_spec, params, x, y, threads=self.threads)


#: data parallelism over every device is the plan a center runs when none is given
DataParallelTrainer = PlannedTrainer
