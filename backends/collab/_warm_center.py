"""A long-lived ClientApp executor for one SuperNode (``flower-supernode --isolation process``).

Flower's default SuperExec starts a fresh ``flwr-clientapp`` process for every message; with torch
that is seconds of imports and model building per round, per center. This process does what that
pair does — take a task token from the SuperNode's Runtime API (``AcquireTask``), pull the message,
run the ClientApp, push the reply and the task status — but runs the ClientApp in-process, so the
imports, the FAB installation, the loaded app and the center's model and data (see
``_flower_app._trainer``) survive from round to round.

It uses the same flwr 1.42 runtime calls as ``flwr.supernode.runtime.run_clientapp`` (pinned version;
these helpers are internal to Flower and may move in another release).

Usage: ``python -m polyparallel.backends.collab._warm_center --runtime-api-address 127.0.0.1:9094``
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from typing import Any

from polyparallel.backends.collab._flwr_timing import set_object_pull_backoff

__all__ = ["RAISED", "client_failures", "serve"]

log = logging.getLogger("polyparallel.collab.warm")
#: the log line of a failed ClientApp task, followed by its traceback (``polyparallel center`` shows the error)
RAISED = "ClientApp raised"
_RECORD = re.compile(r"^(\x1b\[[0-9;]*m)?\s*(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


def client_failures(text: str) -> list[str]:
    """The exception line (``RuntimeError: ...``) of each failed task in a piece of this executor's log."""
    out = []
    for block in text.split(RAISED)[1:]:
        last = ""
        for line in block.splitlines()[1:]:
            if _RECORD.match(line):
                break  # the next log record (ours, or Flower's coloured "INFO :" lines)
            if line.strip() and not line.startswith((" ", "\t", "Traceback", "During handling", "The above")):
                last = line.strip()
        if last:
            out.append(last)
    return out


def _run_task(address: str, token: str, apps: dict[str, Any]) -> None:
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(token)],
        retry_invoker=make_simple_http_retry_invoker())
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, run, fab = pull_task_input(client)
        if fab.hash_str not in apps:
            install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        reply = apps[fab.hash_str](message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # a failing round must not kill the center: report it and keep serving
        log.exception(RAISED)
        details = f"{type(ex).__name__}: {ex}"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client=client, context=context, sub_status=status, details=details)
        finally:
            heartbeat.stop()
            client.close()


def serve(address: str, poll_s: float = 0.05, pull_backoff_s: float | None = None) -> None:
    """Take ClientApp tasks from the SuperNode at ``address`` forever.

    ``pull_backoff_s``: first retry of a message object the SuperNode has not finished pulling from
    the SuperLink (it hands out the task before that; Flower waits 1 s, see :mod:`._flwr_timing`).
    """
    # import the heavy parts now, before round 1, not inside it
    import torch  # noqa: F401
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    import polyparallel.backends.collab._flower_app  # noqa: F401

    if pull_backoff_s:
        set_object_pull_backoff(pull_backoff_s)

    acquirer = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker())
    apps: dict[str, Any] = {}
    while True:
        res = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        if res.HasField("task") and res.token:
            try:
                _run_task(address, res.token, apps)
            except Exception:  # e.g. the run was stopped while we trained: keep serving the next one
                log.exception("task failed")
            continue
        time.sleep(poll_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime-api-address", required=True)
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--pull-backoff-s", type=float, default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a log line per request, dozens per round
    serve(a.runtime_api_address, a.poll_s, a.pull_backoff_s)


if __name__ == "__main__":
    main()
