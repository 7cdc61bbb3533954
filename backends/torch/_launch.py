"""``train``: check the plan, launch the workers with torch.distributed.run, collect the log."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from polyparallel.backends.torch._agent import go, worker_env
from polyparallel.backends.torch._agent import start as start_agent
from polyparallel.backends.torch._agent import take as take_agent
from polyparallel.backends.torch._checkpoint import check_resume, trim_log
from polyparallel.backends.torch._plan import checked_batch, plan_for
from polyparallel.backends.torch._procs import kill_tree, recorded_pids
from polyparallel.backends.torch._tensor_parallel import (
    UncapturedModel,
    forward_problem,
    micro_batch,
    strategy_graph,
)
from polyparallel.references import call_user, resolve
from polyparallel.strategy import Strategy

__all__ = ["MultiNode", "RunDirInUse", "TrainError", "check_batch", "launch_commands", "new_run_dir", "node_layout",
           "train"]


class TrainError(RuntimeError):
    """A worker failed; ``rank``, ``step`` and ``error`` say which, where and why."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None, error: str = "") -> None:
        super().__init__(message)
        self.rank, self.step, self.error = rank, step, error


class MultiNode(ValueError):
    """The strategy spans several nodes: run :func:`train` once per node with ``node_rank``; the
    message lists the per-node ``polyparallel train`` commands (also :func:`launch_commands`)."""


def node_layout(strategy: Strategy) -> list[tuple[str, list[int]]]:
    """``(node name, mesh ranks it runs)`` per node, in rank order, from the strategy's cluster echo.

    torch.distributed.run numbers ranks node by node (``node_rank * nproc_per_node + local_rank``),
    so mesh rank ``r`` (device ``mesh.devices[r]``) can only run where it lands: every node must
    hold one contiguous block of mesh ranks, all blocks of one size. A strategy without a node map
    (or on one node) runs on this machine.
    """
    where = {d: n.get("name", f"node{i}") for c in strategy.cluster.get("centers", [])
             for i, n in enumerate(c.get("nodes", [])) for d in n.get("devices", [])}
    ranks: list[tuple[str, list[int]]] = []
    for r, dev in enumerate(strategy.mesh.devices):
        name = where.get(dev, "")
        if ranks and ranks[-1][0] == name:
            ranks[-1][1].append(r)
        elif any(n == name for n, _ in ranks):
            raise ValueError(f"mesh rank {r} (device {dev}) is on node {name!r}, whose other ranks are not next to "
                             "it in mesh order; torch.distributed.run numbers ranks node by node, so each node "
                             "must hold one contiguous block of the mesh")
        else:
            ranks.append((name, [r]))
    if len({len(rs) for _, rs in ranks}) > 1:
        raise ValueError("nodes run different numbers of mesh ranks ("
                         + ", ".join(f"{n}: {len(rs)}" for n, rs in ranks)
                         + "); torch.distributed.run starts the same number of processes on every node")
    return ranks


def launch_commands(strategy: Strategy | str | Path, model_fn: str, data_fn: str, *, steps: int,
                    master_addr: str = "NODE0_ADDRESS", master_port: int = 29500) -> list[str]:
    """One ``polyparallel train`` command per node of a multi-node strategy (node 0 hosts the
    rendezvous at ``master_addr:master_port``)."""
    path = str(strategy) if not isinstance(strategy, Strategy) else "strategy.json"
    s = strategy if isinstance(strategy, Strategy) else Strategy.from_json(strategy)
    return [f"# on {name} (mesh ranks {rs[0]}..{rs[-1]})\npolyparallel train {path} --model {model_fn} "
            f"--data {data_fn} --steps {steps} --node-rank {i} --master-addr {master_addr} "
            f"--master-port {master_port}" for i, (name, rs) in enumerate(node_layout(s))]


def check_batch(strategy: Strategy, batch: Any) -> None:
    """Refuse, before launch, a first batch ``data_fn(0)`` the workers could not split as the plan
    says: ValueError with one line naming what is wrong and what to change."""
    B = strategy.global_batch
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        what = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, tuple | list) \
            else f"a {type(batch).__name__}"
        raise ValueError(f"data_fn(0) returned {what}; return (inputs, labels): two tensors whose first dim is the "
                         f"strategy's global batch ({B})")
    for name, t in zip(("inputs", "labels"), batch):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"data_fn(0)'s {name} is a {type(t).__name__}; return torch tensors (inputs, labels)")
        if t.dim() == 0 or t.shape[0] != B:
            rows = "a scalar" if t.dim() == 0 else f"{t.shape[0]} rows (shape {tuple(t.shape)})"
            raise ValueError(f"data_fn(0)'s {name} has {rows}, but the strategy's global batch is {B}: return {B} "
                             f"rows per step, or search again with that batch size (--batch-size)")
    labels = batch[1]
    if labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"data_fn(0)'s labels are {labels.dtype}; return integer class ids (torch.long) or float "
                         "targets")
    shares = strategy.dp * strategy.microbatches
    if B % shares:
        raise ValueError(f"the global batch {B} does not split into dp={strategy.dp} x microbatches="
                         f"{strategy.microbatches} = {shares} equal shares; search again with a batch size divisible "
                         f"by {shares}")


def _shape(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def runs_root() -> Path:
    """Where run directories go by default: ``$POLYPARALLEL_RUNS``, else ``runs`` under the current folder."""
    return Path(os.environ.get("POLYPARALLEL_RUNS", "runs"))


def new_run_dir(root: str | Path | None = None) -> Path:
    """A new, empty ``root/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken), created here: a
    name chosen without creating it could be taken by another run of the same second before it is
    used. ``root`` defaults to :func:`runs_root`."""
    root = root if root is not None else runs_root()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1, 1000):
        path = Path(root) / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{root}/{stamp}-*: 999 run directories of this second exist")


class RunDirInUse(ValueError):
    """Another :func:`train` is running in the run directory (:func:`_claim`)."""


@contextlib.contextmanager
def _claim(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this run: an exclusive ``flock`` on the directory, released on leaving
    (or when this process dies). Two runs in one directory overwrite each other's ``job.pkl``, so
    both run whichever was written last, and append to one ``train.jsonl``: the second is refused
    instead (:class:`RunDirInUse`). Unguarded where there is no ``fcntl`` (Windows) or the
    filesystem has no ``flock``."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(f"run directory {run_dir} is in use by another train(); give this run one of its own "
                              "(run_dir, --run-dir; each node of a multi-node run needs its own), or wait for that "
                              "run to end to resume it") from None
        except OSError:  # a filesystem without flock (some network or FUSE mounts): unguarded there
            pass
        yield
    finally:
        os.close(fd)


class _Tail:
    """Follows ``train.jsonl`` as rank 0 appends to it; hands each new step record to ``callback``."""

    def __init__(self, log: Path, first_step: int, callback: Callable[[dict[str, Any]], None] | None) -> None:
        self.log, self.next, self.callback = log, first_step, callback
        self.offset = log.stat().st_size if log.exists() else 0

    def poll(self) -> None:
        if self.callback is None:
            return
        try:
            size = self.log.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:  # rewritten (a resuming rank 0 trims it): read again, skip what was reported
            self.offset = 0
        with self.log.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line being written is read on the next poll
        self.offset += end
        for line in chunk[:end].splitlines():
            rec = json.loads(line) if line.strip() else None
            if rec is not None and rec["step"] >= self.next:
                self.next = rec["step"] + 1
                self.callback(rec)


def train(strategy: Strategy | str | Path, model_fn: Any, data_fn: Any, *, steps: int, optimizer: str = "sgd",
          lr: float = 0.1, seed: int = 0, run_dir: str | Path | None = None, log_dir: str | Path | None = None,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
          keep_checkpoints: int | None = 2, timeout_s: float = 600.0,
          progress: Callable[[dict[str, Any]], None] | None = None, check_fingerprint: bool = True,
          node_rank: int | None = None, master_addr: str = "127.0.0.1", master_port: int = 29500,
          profile_comm: bool = False, profile_memory: bool = False, batchnorm: str = "cross_rank",
          stop_on_nonfinite: bool = True) -> list[dict[str, Any]]:
    """Train ``model_fn()`` as ``strategy`` says on ``dp * sp * tp * pp`` local processes; return the step log.

    ``model_fn`` and ``data_fn`` are ``"package.module:function"`` strings or picklable callables
    (module-level functions). ``model_fn()`` builds the model, whose ``forward(inputs, labels)``
    returns the mean loss; ``data_fn(step)`` returns the global batch ``(inputs, labels)``, which is
    split into equal contiguous shares over the ``dp`` ranks; ``data_fn(0)`` is checked before
    launch (:func:`check_batch`). Every rank seeds torch with ``seed`` before building the model.

    **Run directory.** ``run_dir`` (``log_dir`` is its older name; default: a new
    ``runs/<YYYYmmdd-HHMMSS>`` under the current folder, or ``checkpoint_dir`` when only that is
    given) holds ``job.pkl`` (what the workers run), ``strategy.json`` (the strategy run),
    ``launcher.log`` (torch.distributed.run's and the workers' output, written as they print it;
    appended to on a rerun), ``train.jsonl`` (rank
    0's ``{"step", "loss", "step_time_s", "samples", "tokens", "rank0_input_shape", ...}`` line per
    step: ``samples`` is the global batch's rows, ``tokens`` its numel for integer inputs of >= 2
    dims, ``rank0_input_shape`` rank 0's share after the dp and sp splits, absent with pipeline
    stages), ``failure-rank{R}.json`` for a rank that failed, ``pids/`` and ``checkpoints/``. It is
    created only after every check passed, and held by one run at a time: a second ``train`` in it
    while the first runs is refused (:class:`RunDirInUse`, a ValueError) before it writes anything.
    The log is returned; ``progress(record)``, if given, is called with each record while the
    workers run, as rank 0 writes it.

    **Checkpoints.** With ``checkpoint_dir``, or ``checkpoint_every`` (then in
    ``run_dir/checkpoints``, which also resumes a rerun on the same ``run_dir``), model and
    optimiser are saved with torch.distributed.checkpoint every ``checkpoint_every`` steps (1 by
    default) and after the last; ``keep_checkpoints`` newest ``step-N`` folders are kept (None:
    all). A later call with the same folder resumes after the latest complete checkpoint (a run
    killed mid-way loses no saved step). Each checkpoint holds the strategy that wrote it: resuming
    under a strategy for another model is refused before launch; under another layout without
    pipeline stages (dp/tp/sp/zero_stage) the checkpoint is resharded on load; with pipeline stages
    on either side only the same layout resumes (refused before launch otherwise).

    Before launching, ``model_fn()`` is captured (on the meta device) at the strategy's micro-batch
    size ``global_batch / (dp·microbatches)``, the size the planner fingerprinted, and must have the
    strategy's ``model.fingerprint``; ``check_fingerprint=False`` runs a stand-in model instead (e.g.
    a smaller model with the same module paths), matched to the placements by module path only.

    **Processes.** torch.distributed.run's agent and every worker are killed with the process that
    called ``train`` (Linux: ``PR_SET_PDEATHSIG``), and on every way out of ``train`` (``timeout_s``
    seconds passed since the call, the checks and the capture included; a worker failed; an exception
    such as KeyboardInterrupt) the whole tree is SIGKILLed before it returns or raises (:mod:`._procs`).

    Raises :class:`~polyparallel.backends.torch.Unsupported` (a ValueError) before launching when the
    plan cannot be executed exactly, :class:`~polyparallel.backends.torch.FingerprintMismatch` (a
    ValueError) for another model than the strategy's, ValueError for a first batch or a checkpoint
    that does not fit the strategy, and :class:`TrainError` naming the rank when a worker fails (or
    the timeout when it passed).

    A strategy whose mesh spans several nodes of its cluster (:func:`node_layout`) runs as one
    ``train`` call per node with ``node_rank`` (0 hosts the rendezvous at ``master_addr:master_port``);
    without ``node_rank`` it raises :class:`MultiNode` listing the per-node commands. Only node 0's
    call returns the log (rank 0 writes it).

    ``profile_comm=True`` runs every step under ``torch.profiler`` and adds to each log line
    ``comm_s``, rank 0's seconds inside collectives as torch records them (``gloo:*`` / ``nccl:*``
    events, from issue to completion; they may overlap compute, so this is not the exposed part),
    and ``comm_ops`` (collective -> count). The profiler slows small steps down; off by default.
    ``profile_memory=True`` adds ``peak_memory_bytes``: the most bytes of tensors rank 0 held during
    the step (parameters, gradients, optimizer state, activations, temporaries): CUDA's allocator
    peak on a GPU, torch's ``MemTracker`` (every tensor created, by its storage; compiled blocks run
    eager under it) on the CPU, refused there for plans run by the pipeline schedule, whose backward it
    does not follow; the number the cost model's per-device memory predicts.

    Data-parallel replicas train as single-process training on the global batch does: BatchNorm
    normalises with the statistics of the whole global batch (``batchnorm="cross_rank"``;
    ``"per_replica"`` normalises each replica's share alone, which is cheaper and *not* equal to
    single-process training), and a mean cross entropy with ignored targets is weighted by the
    targets each replica and micro-batch saw (each log line's ``loss_weighting`` says
    ``"tokens"``, or ``"mean_of_means"`` for a loss it cannot count; see ``_worker.py``).

    A step whose loss is NaN or infinite stops the run after its log line (:class:`TrainError`
    naming the step and the likely causes); ``stop_on_nonfinite=False`` trains on.
    """
    if not isinstance(strategy, Strategy):
        strategy = Strategy.from_json(strategy)
    if steps < 1:
        raise ValueError(f"steps={steps}: need at least one step")
    if batchnorm not in ("cross_rank", "per_replica"):
        raise ValueError(f"batchnorm={batchnorm!r}: choose 'cross_rank' or 'per_replica'")
    if optimizer not in ("sgd", "adam", "adamw"):
        raise ValueError(f"optimizer {optimizer!r}: choose sgd, adam or adamw")
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr={lr}: the learning rate must be a positive finite number (e.g. 0.1 for sgd, 1e-3 for "
                         "adam)")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be >= 1")
    if keep_checkpoints is not None and keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints={keep_checkpoints}: keep at least 1 (None keeps all)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
    if run_dir is not None and log_dir is not None and Path(run_dir) != Path(log_dir):
        raise ValueError(f"run_dir={run_dir} and log_dir={log_dir}: log_dir is run_dir's older name, give one")
    for name, folder in (("run_dir", run_dir), ("log_dir", log_dir), ("checkpoint_dir", checkpoint_dir)):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"{name}={folder} is a file; give a folder (created if missing)")
    run_dir = run_dir if run_dir is not None else log_dir if log_dir is not None else checkpoint_dir
    deadline = time.monotonic() + timeout_s  # the checks and the capture count too
    env = worker_env()
    agent = take_agent(env)  # it imports what the ranks need while the checks below run
    try:
        return _checked_run(strategy, model_fn, data_fn, agent, env, steps=steps, optimizer=optimizer, lr=lr,
                            seed=seed, run_dir=run_dir, checkpoint_dir=checkpoint_dir,
                            checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                            timeout_s=timeout_s, deadline=deadline, progress=progress,
                            check_fingerprint=check_fingerprint,
                            node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                            profile_comm=profile_comm, profile_memory=profile_memory, batchnorm=batchnorm,
                            stop_on_nonfinite=stop_on_nonfinite)
    finally:
        if agent.returncode is None:  # refused before launch (or interrupted): it has started nothing
            agent.kill()
            agent.wait()


def _checked_run(strategy: Strategy, model_fn: Any, data_fn: Any, agent: subprocess.Popen[bytes],
                 env: dict[str, str], *, steps: int, optimizer: str, lr: float, seed: int,
                 run_dir: str | Path | None, checkpoint_dir: str | Path | None, checkpoint_every: int | None,
                 keep_checkpoints: int | None, timeout_s: float, deadline: float,
                 progress: Callable[[dict[str, Any]], None] | None,
                 check_fingerprint: bool, node_rank: int | None, master_addr: str, master_port: int,
                 profile_comm: bool, profile_memory: bool, batchnorm: str,
                 stop_on_nonfinite: bool) -> list[dict[str, Any]]:
    """:func:`train` after its argument checks: the checks of batch, model, plan and checkpoint,
    then the run directory and the launch by ``agent``."""
    torch.manual_seed(seed)
    # pipeline stages are cut, and the model captured, on (a micro-batch of) it
    batch = call_user(resolve(data_fn), "the data function", 0)
    torch.manual_seed(seed)
    model = call_user(resolve(model_fn), "the model function")
    graph = None  # plan_for says where a collaborative strategy runs
    if strategy.mode == "synchronous":
        check_batch(strategy, batch)
        try:
            graph = strategy_graph(strategy, resolve(model_fn), batch, check_fingerprint)
        except UncapturedModel:
            # the capture's account (export's and fx's errors) hides a plain cause, data the model
            # cannot take; the forward tried on fake tensors names it and the user's line. Only
            # here: a meta kernel may refuse what the CPU runs (grouped_mm in fp32)
            micro = micro_batch(strategy, batch)
            why = forward_problem(model, micro)
            if why:
                raise ValueError(f"the model's forward fails on a micro-batch of data_fn(0) (inputs "
                                 f"{_shape(micro[0])}, labels {_shape(micro[1])}): {why}; give the model the strategy "
                                 f"was made for ({strategy.model.name}) and data model(inputs, labels) takes") from None
            raise
    # refused before any launch; the batch cuts pipeline stages and tries the forward on tensor-parallel shards
    plan = plan_for(strategy, model, checked_batch(strategy, batch), graph=graph)
    for name, t in zip(("inputs", "labels"), batch) if plan.seq > 1 else ():
        if t.dim() < 2 or t.shape[1] % plan.seq_chunks:
            raise ValueError(f"data_fn(0)'s {name} has shape {tuple(t.shape)}; splitting the sequence over "
                             f"{plan.seq_axis}={plan.seq} needs (batch, seq, ...) with seq divisible by "
                             f"{plan.seq_chunks}")
    if profile_memory and plan.pipeline is not None and not torch.cuda.is_available():
        # pipeline stages, and a model that runs as its exported graph rewritten for its shards (HF LLaMA's sp/cp)
        raise ValueError("profile_memory=True on the CPU counts tensors with torch's MemTracker, which does not "
                         "support the pipeline schedule's backward (autograd.grad) that runs this strategy (pipeline "
                         "stages, or the model's graph rewritten for its shards); run it without profile_memory")
    nproc = plan.world
    nodes = node_layout(strategy)
    if len(nodes) > 1:
        if node_rank is None:
            cmds = launch_commands(strategy, model_fn if isinstance(model_fn, str) else "MODULE:FUNCTION",
                                   data_fn if isinstance(data_fn, str) else "MODULE:FUNCTION", steps=steps)
            raise MultiNode(f"the strategy runs on {len(nodes)} nodes; start one train per node with node_rank "
                            "(--node-rank), node 0 first:\n" + "\n".join(cmds))
        if not 0 <= node_rank < len(nodes):
            raise ValueError(f"node_rank={node_rank}: the strategy has nodes 0..{len(nodes) - 1}")
        nproc //= len(nodes)
    elif node_rank not in (None, 0):
        raise ValueError(f"node_rank={node_rank}, but the strategy runs on one node")
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise ValueError(f"the strategy needs {nproc} GPUs on this machine; {torch.cuda.device_count()} are visible")
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is None and run_dir is not None and (checkpoint_every is not None
                                                 or (Path(run_dir) / "checkpoints").is_dir()):
        ckpt = Path(run_dir) / "checkpoints"
    if ckpt is not None and plan.ep > 1:  # each rank would save only its own 1/ep of the experts
        raise ValueError(f"checkpoints of an expert-parallel run (ep={plan.ep}) are not written: each rank holds "
                         f"1/{plan.ep} of the experts; train without checkpoint_dir/checkpoint_every, or with ep=1")
    done = check_resume(ckpt, strategy, model) if ckpt is not None else None  # refused here, not after launch
    try:
        pickle.dumps((model_fn, data_fn))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"model_fn/data_fn must be 'package.module:function' strings or module-level "
                         f"functions (they are sent to the worker processes): {e}") from e

    # every check passed: from here on, files are written
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir()
    if ckpt is None and checkpoint_every is not None:
        ckpt = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    with _claim(run_dir):  # before anything in it is removed or written
        if ckpt is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
        log = run_dir / "train.jsonl"
        for old in [*run_dir.glob("failure-rank*.json"), *(run_dir / "pids").glob("*.pid")]:
            old.unlink(missing_ok=True)
        if done is None:
            log.unlink(missing_ok=True)
        else:
            trim_log(log, done)  # steps after the checkpoint run again
        job = {"plan": plan, "model_fn": model_fn, "data_fn": data_fn, "steps": steps, "optimizer": optimizer,
               "lr": lr, "seed": seed, "checkpoint_every": checkpoint_every or 1, "profile_comm": profile_comm,
               "profile_memory": profile_memory, "stop_on_nonfinite": stop_on_nonfinite,
               "checkpoint_dir": str(ckpt.resolve()) if ckpt is not None else None,
               "keep_checkpoints": keep_checkpoints, "strategy_json": strategy.to_json(), "batchnorm": batchnorm}
        (run_dir / "job.pkl").write_bytes(pickle.dumps(job))
        strategy.to_json(run_dir / "strategy.json")  # what `polyparallel report --run` checks the run against
        if worker_env() != env:  # sys.path changed while loading model_fn/data_fn: the agent must see it too
            agent.kill()
            agent.wait()
            agent = start_agent(worker_env())
        where = ["--standalone"] if len(nodes) <= 1 else [
            f"--nnodes={len(nodes)}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
            f"--master-port={master_port}"]
        argv = [*where, f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "polyparallel.backends.torch._entry",
                str(run_dir.resolve())]
        try:
            _launch(agent, argv, run_dir, timeout_s, deadline, _Tail(log, 0 if done is None else done + 1, progress))
        finally:
            if agent.returncode is None:
                agent.kill()
                agent.wait()
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def _launch(proc: subprocess.Popen[bytes], argv: list[str], run_dir: Path, timeout_s: float, deadline: float,
            tail: _Tail) -> None:
    """Have the agent ``proc`` run torch.distributed.run ``argv`` with its output streamed to
    ``launcher.log``, follow the step log; kill the whole tree on any way out; raise
    :class:`TrainError` for a failed worker or when ``deadline`` (``time.monotonic()``: the command's
    start plus ``timeout_s``) passes."""
    out_path = run_dir / "launcher.log"
    with out_path.open("ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} torch.distributed.run {' '.join(argv)}\n".encode())
    try:
        go(proc, argv, out_path)
    except OSError:  # the agent died before it was needed (e.g. an import failed): its output says why
        proc.wait()
        raise TrainError(f"the launcher exited with status {proc.returncode} before the launch:\n"
                         f"{proc.stdout.read().decode(errors='replace')[-4000:] if proc.stdout else ''}") from None
    failed_at: float | None = None
    timed_out = False
    try:
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            tail.poll()
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if failed_at is None and any(run_dir.glob("failure-rank*.json")):
                failed_at = now
            elif failed_at is not None and now - failed_at > 10:
                break  # a rank failed but the agent still waits on the others: stop them all below
        tail.poll()
    finally:
        # every way out, including an exception here (Ctrl-C, a test timeout, a raising progress
        # callback): nothing may be left running. Once the agent is reaped its PID may be reused, so
        # then only the recorded workers and their sessions are looked for.
        left = kill_tree(proc.pid if proc.returncode is None else None, recorded_pids(run_dir).items())
        proc.wait()
    if timed_out:
        raise TrainError(f"training did not finish within {timeout_s:g} s of the command's start (checks and "
                         f"capture included); the launcher and its workers were killed{_not_gone(left)}. "
                         f"Output: {out_path}")
    if proc.returncode == 0 and failed_at is None:
        return
    failures = sorted((json.loads(p.read_text()) for p in run_dir.glob("failure-rank*.json")), key=lambda f: f["time"])
    where = f"\n(output: {out_path}; failure reports: {run_dir}/failure-rank*.json){_not_gone(left)}"
    # a rank that died outside Python (a signal such as the out-of-memory killer's, a native abort)
    # wrote no report; its peers then report only the lost connection: the silent rank is the cause
    silent = sorted({int(p.stem[4:]) for p in (run_dir / "pids").glob("rank*.pid") if p.stem[4:].isdigit()}
                    - {f["rank"] for f in failures})
    if failures and silent and all(any(m in f["error"] for m in _PEER_LOST) for f in failures):
        f = failures[0]
        raise TrainError(f"rank {silent[0]} died without a failure report (a signal, e.g. the out-of-memory "
                         f"killer's, or a native abort: look for its last lines in {out_path}); rank {f['rank']} then "
                         f"lost its connection at step {f['step']}: {f['error']}{where}",
                         rank=silent[0], step=f["step"], error="died without a failure report")
    # otherwise the first rank to fail is the cause; the others typically died of its absence
    if failures:
        f = failures[0]
        raise TrainError(f"rank {f['rank']} failed at step {f['step']}: {f['error']}\n{f['traceback']}{where}",
                         rank=f["rank"], step=f["step"], error=f["error"])
    text = out_path.read_text(errors="replace")
    text = text[text.rfind("\n=== "):]  # this launch's part
    # no failure file: the rank died outside Python (a signal, an abort); the elastic agent's
    # summary names the root-cause rank
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*", text, re.S)
    if m:
        raise TrainError(f"rank {m.group(1)} failed (exit code {m.group(2)}); launcher output:\n{text[-4000:]}{where}",
                         rank=int(m.group(1)), error=f"exit code {m.group(2)}")
    raise TrainError(f"torch.distributed.run exited with status {proc.returncode}:\n{text[-4000:]}{where}")


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")  # gloo's words for it


def _not_gone(pids: list[int]) -> str:
    return f" (still running after SIGKILL: PIDs {pids})" if pids else ""
