"""A Flower ClientApp with one misbehaving center, for the adversarial tests over Flower.

Every center runs polyparallel's ClientApp; the center named :data:`REPLAYER` keeps its round-1 update
(in ``context.state``, which its SuperNode holds across the run's messages) and, from round 2 on, sends
it again in place of its fresh update, with this round's metrics: the round index, the digest of this
round's model and the binding recomputed under this round's nonce (the center receives the nonce, so
it can forge all three). Only the bytes of the update are old.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from polyparallel.backends.collab import _flower_app
from polyparallel.backends.collab._validation import bound_metrics, model_digest
from polyparallel.backends.collab._wire import unpack_arrays

REPLAYER = "c"
_KEPT = "replayed-update"  # context.state key: the round-1 update's arrays

client_app = ClientApp()


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    reply = _flower_app.client_app(message=msg, context=context)  # the honest work, then the forgery
    center = str(context.node_config["center"])
    if center != REPLAYER or reply.has_error():
        return reply
    content = reply.content
    fresh = unpack_arrays(_arrays(content["update"]), dict(content["layout"]))
    if _KEPT not in context.state:
        context.state[_KEPT] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in fresh.items()})
        return reply
    old = _arrays(context.state[_KEPT])
    r, nonce = int(msg.content["config"]["round"]), int(msg.content["config"]["nonce"])
    digest = model_digest(unpack_arrays(_arrays(msg.content["arrays"]), dict(msg.content["layout"])))
    metrics = {**{k: float(v) for k, v in dict(content["metrics"]).items()}, **bound_metrics(nonce, r, digest, old)}
    return Message(_flower_app.reply_content(old, metrics, center), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return _flower_app.client_app(message=msg, context=context)
