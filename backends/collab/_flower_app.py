"""Flower ``ServerApp`` and ``ClientApp`` running the collab round logic (flwr 1.42 Message API).

The ServerApp owns a :class:`~._server.FederationServer`; every round it sends the global model to
each connected SuperNode as a ``train`` message, pulls the replies itself (a short poll instead of
``Grid.send_and_receive``'s fixed 3 s sleep), and fuses. It stops waiting at
``config.round_timeout_s``: a center that died mid-round is then simply missing, and the round fuses
when ``min_centers`` replies are valid. It writes everything to ``out-dir`` from the run config.

Messages (all a center ever sends is in :func:`reply_content`):

- server → center: ``arrays`` + ``layout`` (the global model under torch names, packed by
  :func:`~._wire.pack_arrays`: an ArrayRecord with one flat buffer per dtype and a ConfigRecord of
  names, dtypes and shapes), ``config`` (ConfigRecord: ``round``, ``nonce`` (drawn afresh for the round; the
  reply's ``binding`` metric ties its update to it, see :mod:`._validation`), ``proximal_mu``), and for SCAFFOLD
  ``control`` + ``control-layout`` (the server's control variate ``c``, packed the same way); a pruning job,
  once the server has cut, ``pruning`` (ConfigRecord: ``plan``, the JSON plan the center cuts its own model
  with, once, before training or evaluating: :func:`~._pruning_foreign.conform`);
- center → server: ``update`` + ``layout`` (the encoded update, see :mod:`._wire`, packed the same
  way; for SCAFFOLD it also holds the center's ``c_i⁺`` under ``c/`` keys, in a pruning job's scoring rounds its
  channel scores under ``p/`` keys, :mod:`._pruning`), ``metrics`` (MetricRecord:
  numbers only), ``center`` (ConfigRecord: ``name``).

SCAFFOLD's per-center ``c_i`` stays at the center: the ClientApp keeps it in ``context.state``
(ArrayRecord ``scaffold-ci``), which the SuperNode holds per run and hands to the ClientApp with every
message, storing the changed state back after the reply — so it survives from round to round both in
the long-lived warm executor and with a fresh ClientApp process per message, and it never travels to
the SuperLink. A new run (a restarted server submits one) starts with an empty state: each center then
corrects with ``c_i = 0`` for one round (see :class:`~._fusion.Scaffold`).

Packing matters for speed only: Flower moves each array (and each 5 MB chunk of it) as its own
object with an HTTP request per hop (server → SuperLink → SuperNode → ClientApp and back); packed, a
message is 7 objects (plus a chunk per 5 MB) whatever the number of tensors.

The lean path (run config ``data-channel`` = ``socket``, :mod:`._lean`): the ServerApp sends each center
one ``train`` message for the whole run, holding only ``channel`` (a ConfigRecord: the server's address
and a token for that node); the ClientApp connects and serves every round over that connection
(:func:`_channel_center`; an overlapped center runs ahead there, :class:`~._overlap.OverlapCenter`) and
answers the message when the run ends.

Evaluation: with ``eval-data`` the ServerApp evaluates each fused model itself. Without it and with
``holdout > 0`` in the job, it sends the fused model to every center as an ``evaluate`` message
(``arrays`` + ``layout``); a center answers with numbers only — ``metrics`` (its loss, accuracy or
perplexity and ``count`` on its held-out rows) and ``center`` — and the server records the
count-weighted mean (:func:`~._server.aggregate_evaluations`).

The user's model and data sources travel as ``"package.module:function"`` references inside the job;
each SuperNode's ClientApp and the ServerApp import them, so their modules must be importable there
(:class:`~._flower.LoopbackFederation` passes this process's import path down as ``PYTHONPATH``). When
the ServerApp fails (say it cannot import the model), it writes ``failed.json`` (the error) to
``out-dir``; when every center fails round 1 (say none can import it), it stops with their errors.

Identity: with node authentication, the submitter passes ``node-names`` (JSON ``{node id: center}``,
what the SuperLink answered when each center's key was registered). A reply is then counted only
under the name registered for the node that sent it (``Message.metadata.src_node_id``, which the
SuperLink sets from the authenticated key): a node claiming another center's name is refused, logged
and recorded under ``rejected`` as ``"NAME@node ID"``; the real center is unaffected.

Log: the ServerApp's log (``polyparallel.collab``: rejections, refused identities, resumption, rounds
that did not fuse) is written to ``out-dir/server.log``, which ``polyparallel serve`` prints.

Run config keys: ``collab-config`` (the :class:`~._config.CollabConfig` JSON), ``out-dir``,
``eval-data`` (optional ``.npz`` with ``x``, ``y``), ``root-data`` (the server's root set, ``.npz``, for
FLTrust), ``poll-s``, ``pull-backoff-s`` (first retry of
a reply object not yet at the SuperLink; 0: Flower's 1 s), ``max-rounds`` (exit after that many
rounds, as a server taken down between rounds; 0: run to the end), ``node-names`` (above),
``rejoin-wait-s`` (before a round after the first, wait up to so long for every center to be connected:
a grace for a center that is restarting, spent once per lost center (:func:`rejoin_grace`); default
:data:`REJOIN_WAIT_S`; 0: start with ``required_centers``),
``superlink-pid`` (the ServerApp exits when that process is gone), ``center-wait-s`` (how long to wait
for ``required_centers`` connected centers before a round; the
ServerApp fails after that rather than record rounds nobody could train). Node config keys: ``center``, ``data``
(``.npz`` with the center's ``x``, ``y``, or a ``package.module:function`` data source called with the
center's name; empty: the job's ``CenterSpec.data``). ``pack-arrays`` (default true) false sends the
arrays tensor by tensor with no ``layout`` (a center answers in the format it received; for the benchmark).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import traceback
from functools import lru_cache
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from polyparallel.backends.torch._procs import alive

from ._center import LocalTrainer, center_evaluate, center_round, evaluate_torch, load_center_data
from ._config import REJOIN_WAIT_S, CollabConfig, FlowerRun
from ._engine import initial_params
from ._flwr_timing import set_object_pull_backoff
from ._lean import serve_center, serve_rounds
from ._link import LinkThrottle, nbytes_of
from ._overlap import OverlapCenter
from ._pruning_foreign import conform
from ._server import CenterReply, FederationServer, TimingLog, aggregate_evaluations
from ._trainers import make_trainer
from ._wire import pack_arrays, unpack_arrays

__all__ = ["REJOIN_WAIT_S", "client_app", "rejoin_grace", "reply_content", "server_app"]

log = logging.getLogger("polyparallel.collab")

server_app = ServerApp()
client_app = ClientApp()


def _to_records(arrays: dict[str, np.ndarray], pack: bool = True) -> dict[str, ArrayRecord | ConfigRecord]:
    """``{"arrays": ..., "layout": ...}`` packed (one buffer per dtype), or ``{"arrays": ...}`` tensor by tensor."""
    if not pack:
        return {"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})}
    buffers, layout = pack_arrays(arrays)
    return {"arrays": ArrayRecord({k: Array(v) for k, v in buffers.items()}), "layout": ConfigRecord(layout)}


def _from_records(content: RecordDict, key: str = "arrays", layout: str = "layout") -> dict[str, np.ndarray]:
    """The arrays under ``key``, unpacked when the message carries a ``layout``."""
    arrays = {k: v.numpy() for k, v in content[key].items()}
    return unpack_arrays(arrays, dict(content[layout])) if layout in content else arrays


_CI_KEY = "scaffold-ci"  # the center's SCAFFOLD control variate in context.state
_PLAN_KEY = "pruning"  # a pruned job's messages after the cut: ConfigRecord {"plan": JSON of the pruning plan}


def _plan_records(server: FederationServer) -> dict[str, ConfigRecord]:
    """The pruning plan, once the server has cut, for a message to a center (which cuts its model alike)."""
    plan = server.cut_plan
    return {} if plan is None else {_PLAN_KEY: ConfigRecord({"plan": json.dumps(plan)})}


def _conform_to(msg: Message, trainer: LocalTrainer) -> None:
    """Give the center's model the architecture of the plan the message carries (once per trainer)."""
    if _PLAN_KEY in msg.content:
        conform(trainer, json.loads(str(msg.content[_PLAN_KEY]["plan"])))


# --------------------------------------------------------------------------------------------- center
@lru_cache(maxsize=8)
def _trainer(config_json: str, center: str, data: str) -> LocalTrainer:
    # cached: a long-lived client process builds its model and loads its data once, not every round
    config = CollabConfig.from_json(config_json)
    source = data or config.center(center).data
    if not source:
        raise ValueError(f"center {center!r} has no data: give the SuperNode node-config data=FILE.npz or "
                         "package.module:function, or the job's CenterSpec(data=...)")
    return make_trainer(config, center, *load_center_data(source, center))


def _node_trainer(context: Context) -> tuple[CollabConfig, str, LocalTrainer]:
    config_json = str(context.run_config["collab-config"])
    center = str(context.node_config["center"])
    return CollabConfig.from_json(config_json), center, _trainer(config_json, center,
                                                                 str(context.node_config.get("data", "")))


def reply_content(payload: dict[str, np.ndarray], metrics: dict[str, float], center: str,
                  pack: bool = True) -> RecordDict:
    """The whole of what a center sends back: the encoded update, numbers, and its name."""
    rec = _to_records(payload, pack)
    return RecordDict({"update": rec["arrays"], **({"layout": rec["layout"]} if pack else {}),
                       "metrics": MetricRecord(dict(metrics)), "center": ConfigRecord({"name": center})})


@lru_cache(maxsize=8)
def _link(config_json: str, center: str) -> LinkThrottle:
    # one per center process, kept between rounds: the link's transfers queue behind each other
    return LinkThrottle.of(CollabConfig.from_json(config_json).center(center))


def _channel_center(msg: Message, context: Context) -> Message:
    """Serve every round of the run over the data channel the invitation names (see :mod:`._lean`)."""
    config, center, trainer = _node_trainer(context)
    link = _link(str(context.run_config["collab-config"]), center)
    state: dict[str, np.ndarray] = {}  # SCAFFOLD's c_i, kept for the run
    ahead = OverlapCenter(trainer, config) if config.overlap else None  # overlapped fusion (see _overlap)
    mu = [0.0]

    def on_train(model: dict, control: dict | None, cfg: dict, t_sent: float,
                 outer_u: dict | None = None) -> tuple[dict, dict]:
        link.download(nbytes_of(model) + sum(nbytes_of(a) for a in (control, outer_u) if a), sent_at=t_sent)
        mu[0] = float(cfg["proximal_mu"])
        if ahead is not None:
            return ahead.finish(int(cfg["round"]), model, int(cfg["nonce"]), mu[0], control=control, outer_u=outer_u)
        return center_round(trainer, model, round_idx=int(cfg["round"]), config=config,
                            proximal_mu=float(cfg["proximal_mu"]), t_received=time.time(), control=control,
                            center_state=state, nonce=int(cfg["nonce"]))

    ch = msg.content["channel"]
    n = serve_center(str(ch["address"]), str(ch["token"]), center, on_train, lambda p: center_evaluate(trainer, p),
                     config.round_timeout_s, 1 << 36, on_sent=None if ahead is None else lambda: ahead.ahead(mu[0]),
                     on_plan=lambda plan: conform(trainer, plan))
    return Message(RecordDict({"center": ConfigRecord({"name": center, "rounds": n})}), reply_to=msg)


@client_app.train()
def _center_train(msg: Message, context: Context) -> Message:
    if "channel" in msg.content:  # the lean message path: this one message serves the whole run
        return _channel_center(msg, context)
    link = _link(str(context.run_config["collab-config"]), str(context.node_config["center"]))
    # an emulated WAN link: the model's bytes arrive latency + bytes / bandwidth after the server sent them
    link.download(sum(nbytes_of(v) for v in msg.content.array_records.values()), sent_at=msg.metadata.created_at)
    t_received = time.time()
    config, center, trainer = _node_trainer(context)
    _conform_to(msg, trainer)
    global_params = _from_records(msg.content)
    cfg = msg.content["config"]
    control, ci = None, None
    if "control" in msg.content:
        control = _from_records(msg.content, "control", "control-layout")
        ci = {k: v.numpy() for k, v in context.state[_CI_KEY].items()} if _CI_KEY in context.state else {}
    payload, metrics = center_round(trainer, global_params, round_idx=int(cfg["round"]), config=config,
                                    proximal_mu=float(cfg["proximal_mu"]), t_received=t_received,
                                    control=control, center_state=ci,
                                    nonce=int(cfg["nonce"]) if "nonce" in cfg else None)
    if ci is not None:
        context.state[_CI_KEY] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in ci.items()})
    # the upload's emulated link is held at the server (ServerApp), from this message's created_at
    return Message(reply_content(payload, metrics, center, pack="layout" in msg.content), reply_to=msg)


@client_app.evaluate()
def _center_evaluate(msg: Message, context: Context) -> Message:
    # the fused model on this center's held-out rows: numbers and the center's name go back, nothing else
    _, center, trainer = _node_trainer(context)
    _conform_to(msg, trainer)
    metrics = center_evaluate(trainer, _from_records(msg.content))
    return Message(RecordDict({"metrics": MetricRecord(metrics), "center": ConfigRecord({"name": center})}),
                   reply_to=msg)


# --------------------------------------------------------------------------------------------- server
def rejoin_grace(wait_s: float, connected: int, centers: int, settled: int | None) -> float:
    """How long to wait before a later round for every center to be connected.

    ``wait_s`` when some center is missing and the server has not already waited that long for the
    centers missing now (``settled``: the count connected at the end of the last full grace; fewer
    now means another center was lost); 0 when all are there, or once a grace passed without them —
    a center gone for good costs one grace, not one per round.
    """
    if wait_s <= 0 or connected >= centers or (settled is not None and connected >= settled):
        return 0.0
    return wait_s


def _wait_for_nodes(grid: Grid, want: int, timeout_s: float, poll_s: float, need: int = 0,
                    need_s: float = 0.0) -> list[int]:
    """The connected nodes once ``want`` are, or after ``timeout_s``; but not before ``need`` are
    (waiting up to ``need_s`` for them, then raising: a round nobody can fuse would be a round lost)."""
    t0 = time.time()
    while True:
        nodes = sorted(grid.get_node_ids())
        waited = time.time() - t0
        if len(nodes) >= want or (waited > timeout_s and len(nodes) >= need):
            return nodes
        if waited > max(timeout_s, need_s):
            raise RuntimeError(f"{len(nodes)} centers connected after {waited:.0f} s, {need} needed for a round")
        time.sleep(poll_s)


def _identity_problem(m: Message, node_names: dict[int, str]) -> str | None:
    """Why a reply cannot be counted under the center name it carries (None: it can, or no registry)."""
    if not node_names or m.has_error():
        return None
    claimed, node = _center_of(m), m.metadata.src_node_id
    registered = node_names.get(node)
    if registered is None:
        return f"node {node} claims to be {claimed!r} but no key was registered for it"
    if claimed != registered:
        return f"node {node} holds the key registered for {registered!r} but claims to be {claimed!r}"
    return None


def _center_of(m: Message) -> str | None:
    try:
        return None if m.has_error() else str(m.content["center"]["name"])
    except (KeyError, TypeError):
        return None


def _exchange(grid: Grid, messages: list[Message], centers: set[str], timeout_s: float,
              poll_s: float, node_names: dict[int, str] | None = None) -> list[tuple[Message, float]]:
    """Push ``messages`` and pull replies until every message or every center answered, or the timeout.

    Stopping once every center answered matters after a crash: the dead SuperNode stays registered
    until its heartbeat expires, and its message would otherwise hold the round to the timeout.
    """
    ids = set(grid.push_messages(messages))
    end = time.time() + timeout_s
    got: list[tuple[Message, float]] = []
    while ids and time.time() < end:
        for m in grid.pull_messages(ids):
            ids.discard(m.metadata.reply_to_message_id)
            got.append((m, time.time()))
        if centers <= {_center_of(m) for m, _ in got if _identity_problem(m, node_names or {}) is None}:
            break
        if ids:
            time.sleep(poll_s)
    return got


def _federated_evaluate(grid: Grid, nodes: list[int], config: CollabConfig, params: dict[str, np.ndarray],
                        round_idx: int, pack: bool, poll_s: float,
                        node_names: dict[int, str] | None = None,
                        extra: dict[str, ConfigRecord] | None = None) -> dict[str, float]:
    """Send ``params`` (and ``extra`` records: the pruning plan) to the centers as ``evaluate`` messages;
    the count-weighted mean of their answers."""
    msgs = [grid.create_message(RecordDict({**_to_records(params, pack), **(extra or {})}), "evaluate", n,
                                group_id=f"{round_idx}-eval") for n in nodes]
    per: dict[str, dict[str, float]] = {}
    for m, _ in _exchange(grid, msgs, {c.name for c in config.centers}, config.round_timeout_s, poll_s, node_names):
        if (why := _identity_problem(m, node_names or {})) is not None:
            log.warning("round %d: refused an evaluation: %s", round_idx, why)
            continue
        if m.has_error():
            log.warning("round %d: evaluation failed at node %d: %s", round_idx, m.metadata.src_node_id, m.error)
            continue
        try:
            per[str(m.content["center"]["name"])] = {k: float(v) for k, v in dict(m.content["metrics"]).items()}
        except (KeyError, TypeError, ValueError) as e:
            log.warning("round %d: malformed evaluation from node %d dropped: %r", round_idx, m.metadata.src_node_id, e)
    return aggregate_evaluations(per)


def _exit_with(pid: int, every_s: float = 0.5) -> None:
    """Leave (quietly: no ``failed.json``) once process ``pid``, the SuperLink, is gone.

    Flower starts the ServerApp detached from the SuperLink; when the SuperLink is killed the ServerApp
    would retry for ~10 s and then fail, possibly writing ``failed.json`` into the out-dir that a
    restarted server is already resuming from."""
    while alive(pid):
        time.sleep(every_s)
    os._exit(3)


@server_app.main()
def _serve(grid: Grid, context: Context) -> None:
    run = FlowerRun.of(context.run_config)
    if run.superlink_pid:
        threading.Thread(target=_exit_with, args=(run.superlink_pid,), daemon=True).start()
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "server.log")  # the submitter (``serve``) shows it to the user
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("polyparallel.collab")
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        _serve_rounds(grid, run, out)
    except BaseException as e:  # the submitter waits on out-dir: tell it why instead of letting it time out
        log.error("the ServerApp failed: %s: %s", type(e).__name__, e)
        (out / "failed.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                     "traceback": traceback.format_exc()}))
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def _serve_rounds(grid: Grid, run: FlowerRun, out: Path) -> None:
    config = CollabConfig.from_json(run.collab_config)
    poll_s, pack = run.poll_s, run.pack_arrays
    if run.pull_backoff_s > 0:  # see _flwr_timing: Flower's 1 s first retry of a reply object
        set_object_pull_backoff(run.pull_backoff_s)
    evaluate = None
    if run.eval_data:
        with np.load(run.eval_data) as z:
            ex, ey = z["x"], z["y"]

        def evaluate(p: dict[str, np.ndarray]) -> dict[str, float]:
            # a pruned job's model is the server's own, cut to the plan (as in-process)
            return evaluate_torch(config.model, p, ex, ey, model=server.pruning.model if server.pruning else None)

    node_names = run.names()
    center_wait_s, rejoin_wait_s = run.center_wait_s, run.rejoin_wait_s
    root = None
    if run.root_data:
        with np.load(run.root_data) as z:
            root = (z["x"], z["y"])
    server = FederationServer(config, initial_params(config), TimingLog(out / "timing.jsonl"), out / "checkpoint",
                              root=root)
    server.resume()
    recorded = (out / "rounds.jsonl").read_text().count("\n") if (out / "rounds.jsonl").exists() else 0
    if recorded < server.round:  # killed between the checkpoint and the record: the model has the round
        log.warning("rounds.jsonl records %d rounds, the checkpoint %d: the record of round %d was lost with the "
                    "server that fused it", recorded, server.round, server.round)
    log.info("serving rounds %d..%d of %d centers%s", server.round + 1, config.rounds, len(config.centers),
             f" (identities bound to {len(node_names)} registered keys)" if node_names else "")
    first = True
    settled: int | None = None  # connected centers after a whole grace that did not bring the rest back
    links = {c.name: LinkThrottle.of(c) for c in config.centers if LinkThrottle.of(c).limited}
    stop_after = run.max_rounds or None
    ran = 0
    channel = run.data_channel == "socket"
    if channel:  # the lean message path (see _lean): one Flower message per center for the whole run
        nodes = _wait_for_nodes(grid, len(config.centers), config.round_timeout_s, poll_s,
                                need=config.required_centers, need_s=center_wait_s)
        serve_rounds(grid, server, config, nodes, node_names, out, evaluate, links, stop_after=stop_after)
    while not channel and not server.done and (stop_after is None or ran < stop_after):
        ran += 1
        grace = config.round_timeout_s if first else rejoin_grace(rejoin_wait_s, len(grid.get_node_ids()),
                                                                   len(config.centers), settled)
        nodes = _wait_for_nodes(grid, len(config.centers) if grace else config.required_centers, grace, poll_s,
                                need=config.required_centers, need_s=center_wait_s)
        settled = len(nodes) if len(nodes) < len(config.centers) else None
        first = False
        r, params = server.begin_round()
        content = {**_to_records(params, pack),
                   "config": ConfigRecord({"round": r, "nonce": server.nonce(r),
                                           "proximal_mu": server.fusion.proximal_mu}), **_plan_records(server)}
        control = server.control()
        if control is not None:
            rec = _to_records(control, pack)
            content.update({"control": rec["arrays"], **({"control-layout": rec["layout"]} if pack else {})})
        msgs = [grid.create_message(RecordDict(dict(content)), "train", n, group_id=str(r)) for n in nodes]
        replies: list[CenterReply] = []
        errors: list[str] = []
        refused: dict[str, tuple[str, ...]] = {}
        delivered: list[float] = []
        for m, t_arrived in _exchange(grid, msgs, {c.name for c in config.centers}, config.round_timeout_s, poll_s,
                                      node_names):
            if (why := _identity_problem(m, node_names)) is not None:
                log.warning("round %d: refused a reply: %s", r, why)
                who = f"{_center_of(m)}@node{m.metadata.src_node_id}"
                refused[who] = (why,)
                server.timing.record(r, "server", who, "rejected", reason=why)
                continue
            if m.has_error():
                log.warning("round %d: node %d answered with an error: %s", r, m.metadata.src_node_id, m.error)
                errors.append(f"node {m.metadata.src_node_id}: {m.error.reason}")
                continue
            try:
                c = m.content
                replies.append(CenterReply(str(c["center"]["name"]), _from_records(c, "update"),
                                           dict(c["metrics"])))
                if replies[-1].center in links:  # an emulated uplink: received when the link would deliver it
                    t_arrived = links[replies[-1].center].delivered(
                        "up", sum(nbytes_of(v) for v in c.array_records.values()), m.metadata.created_at, t_arrived)
                    delivered.append(t_arrived)
                server.timing.record(r, "server", replies[-1].center, "update_received", t=t_arrived)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("round %d: malformed reply from node %d dropped: %r", r, m.metadata.src_node_id, e)
        if errors and not replies and server.round == 0:  # nobody can train: a setup error, not a bad round
            raise RuntimeError("every center failed round 1: " + " | ".join(errors))
        if delivered and max(delivered) > time.time():
            time.sleep(max(delivered) - time.time())
        round_eval = evaluate
        if round_eval is None and config.holdout > 0:
            def round_eval(p: dict[str, np.ndarray], nodes: list[int] = nodes, r: int = r) -> dict[str, float]:
                return _federated_evaluate(grid, nodes, config, p, r, pack, poll_s, node_names,
                                           _plan_records(server))
        rec = server.finish_round(r, replies, sent_to=len(nodes), evaluate=round_eval)
        if refused:
            rec = dataclasses.replace(rec, rejected={**rec.rejected, **refused})
        with (out / "rounds.jsonl").open("a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")
    if not server.done:  # leaves like a server taken down between rounds; a new one resumes
        (out / f"stopped-after-{server.round}.json").write_text(json.dumps({"rounds": server.round}))
        return
    np.savez(out / "final.npz", **server.params)
    if server.pruning is not None:  # what the release needs (read back by _flower.read_outputs)
        outcome = server.pruning.outcome()
        if outcome["cut_params"] is not None:
            np.savez(out / "pruning_cut.npz", **outcome["cut_params"])
        (out / "pruning.json").write_text(json.dumps({k: v for k, v in outcome.items() if k != "cut_params"}))
    (out / "done.json").write_text(json.dumps({"rounds": server.round}))

