"""The ``torch.fx.symbolic_trace`` fallback, for a model ``torch.export`` cannot capture.

The model is traced symbolically (forward parameters the caller did not give fixed to their
defaults) and its shapes propagated with ``ShapeProp``; leaf modules (``nn.Linear``,
``nn.Conv2d``...) are mapped onto the handlers of the ATen ops they compute (:func:`_leaf_args`),
Tensor methods are named with an ATen overload's schema (:func:`_method_args`), and shape queries
(``x.size()``, ``x.dim()``) are answered from the graph's shapes at capture time.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import operator
from typing import Any

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp

from polyparallel.ir import Graph, TensorKind

from .._builder import GraphBuilder
from ._capture import _aten_for, _base_name, _dtype_name, _FakeVal, _named_args, _Walker
from ._registry import TRef, _flat_args


# nn.Module leaf types the fx fallback maps onto handlers: type name -> (handler name, arg builder)
def _leaf_args(mod: torch.nn.Module, x: Any) -> tuple[str, dict[str, Any]] | None:
    nn = torch.nn
    if isinstance(mod, nn.Linear):
        return "linear", {"input": x, "weight": mod.weight, "bias": mod.bias}
    if isinstance(mod, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        return "conv_transpose2d", {"input": x, "weight": mod.weight, "bias": mod.bias, "stride": mod.stride,
                                    "padding": mod.padding, "output_padding": mod.output_padding,
                                    "dilation": mod.dilation, "groups": mod.groups}
    if isinstance(mod, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return "conv2d", {"input": x, "weight": mod.weight, "bias": mod.bias, "stride": mod.stride,
                          "padding": mod.padding, "dilation": mod.dilation, "groups": mod.groups}
    if isinstance(mod, nn.LayerNorm):
        return "layer_norm", {"input": x, "normalized_shape": mod.normalized_shape, "weight": mod.weight,
                              "bias": mod.bias}
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return "batch_norm", {"input": x, "weight": mod.weight, "bias": mod.bias, "training": mod.training,
                              "running_mean": mod.running_mean, "running_var": mod.running_var}
    if isinstance(mod, nn.GroupNorm):
        return "group_norm", {"input": x, "num_groups": mod.num_groups, "weight": mod.weight, "bias": mod.bias}
    if isinstance(mod, nn.Embedding):
        return "embedding", {"weight": mod.weight, "indices": x}
    if isinstance(mod, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d | nn.AvgPool1d | nn.AvgPool2d | nn.AvgPool3d):
        return ("max_pool2d" if "Max" in type(mod).__name__ else "avg_pool2d"), {
            "self": x, "kernel_size": mod.kernel_size, "stride": mod.stride, "padding": mod.padding,
            "dilation": getattr(mod, "dilation", 1), "ceil_mode": mod.ceil_mode}
    if isinstance(mod, nn.AdaptiveAvgPool1d | nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d):
        return "adaptive_avg_pool2d", {"self": x, "output_size": mod.output_size}
    if isinstance(mod, nn.Softmax | nn.LogSoftmax):
        return ("log_softmax" if "Log" in type(mod).__name__ else "softmax"), {"self": x, "dim": mod.dim}
    if isinstance(mod, nn.Flatten):
        return "flatten", {"self": x}
    if isinstance(mod, nn.Dropout | nn.Identity | nn.ReLU | nn.GELU | nn.SiLU | nn.Tanh | nn.Sigmoid
                  | nn.LeakyReLU | nn.ELU | nn.Hardswish | nn.Mish | nn.Softplus | nn.ReLU6):
        return type(mod).__name__.lower().replace("relu6", "hardtanh"), {"self": x}
    return None


def _fx(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> Graph:
    # forward parameters the caller did not give are fixed to their defaults, so that
    # `if labels is None:` branches are traced the way the example call takes them
    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    concrete = {n: p.default for n, p in sig.parameters.items()
                if n not in bound.arguments and p.default is not inspect.Parameter.empty}
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    with contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints each failure's traceback, then raises it
        ShapeProp(gm).propagate(*[bound.arguments[n] for n in sig.parameters if n in bound.arguments])
    gb = GraphBuilder(name, "torch.fx")
    w = _Walker(gb)
    graph = gb.graph
    seen_params: dict[int, TRef] = {}

    def param_ref(t: torch.Tensor | None, path: str) -> TRef | None:
        if t is None:
            return None
        if id(t) not in seen_params:
            kind = TensorKind.PARAM if isinstance(t, torch.nn.Parameter) and t.requires_grad else TensorKind.BUFFER
            n = gb.unique("p_" + path.replace(".", "_"), "tensor")
            gb.tensor(n, tuple(t.shape), _dtype_name(t.dtype), kind, path)
            seen_params[id(t)] = TRef(n)
        return seen_params[id(t)]

    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        param_ref(p, pname)
    for node in gm.graph.nodes:
        tm = node.meta.get("tensor_meta")
        if tm is not None:
            node.meta["val"] = _FakeVal(tm)
        if node.op == "placeholder":
            ref = w.tensor_for(node, node.meta.get("val"), TensorKind.INPUT)
            w.env[node] = ref
            if isinstance(ref, TRef):
                graph.inputs.append(ref)
        elif node.op == "get_attr":
            t = _get_attr(gm, str(node.target))
            w.env[node] = param_ref(t, str(node.target)) if isinstance(t, torch.Tensor) else t
        elif node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            x = w.resolve(node.args[0]) if node.args else None
            leaf = _leaf_args(mod, x)
            if leaf is None:
                bname, args = type(mod).__name__, {"input": w.resolve(list(node.args))}
            else:
                bname, args = leaf
                for k, v in list(args.items()):
                    if isinstance(v, torch.Tensor):
                        args[k] = param_ref(v, f"{node.target}.{k}")
            w.call(node, bname, f"{type(mod).__module__}.{type(mod).__name__}", None, args, str(node.target))
        elif node.op == "call_function":
            bname, tstr = _base_name(node.target)
            args = _named_args(node.target, w.resolve(node.args), w.resolve(dict(node.kwargs)))
            if node.target is operator.getitem:
                args = {"a": w.resolve(node.args[0]), "b": node.args[1]}
            w.call(node, bname, tstr, _aten_for(bname), args, "")
        elif node.op == "call_method":
            target = getattr(torch.Tensor, str(node.target), None)
            rargs = w.resolve(node.args)
            args = _method_args(str(node.target), rargs, w.resolve(dict(node.kwargs)))
            if str(node.target) in ("size", "dim", "numel", "stride"):
                w.env[node] = _py_value(rargs, str(node.target), graph)
                continue
            w.call(node, str(node.target).removesuffix("_"), f"Tensor.{node.target}", target, args, "")
        elif node.op == "output":
            for v in _flat_args(w.resolve(node.args[0])):
                if isinstance(v, TRef):
                    graph.outputs.append(v)
    return gb.finish()


def _method_args(method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name a Tensor method's arguments with the first ATen overload that takes that many."""
    aten = getattr(torch.ops.aten, method, None)
    if aten is not None:
        for ov in aten.overloads():
            overload = getattr(aten, ov)
            if len(args) <= len(overload._schema.arguments):
                return _named_args(overload, args, kwargs)
    out = {"self": args[0] if args else None}
    out.update({f"arg{i}": v for i, v in enumerate(args[1:], 1)})
    out.update(kwargs)
    return out


def _py_value(args: tuple, method: str, graph: Graph) -> Any:
    t = args[0]
    if not isinstance(t, TRef):
        return None
    shape = graph.tensors[t].shape
    if method == "size":
        return shape[args[1]] if len(args) > 1 else torch.Size(shape)
    if method == "dim":
        return len(shape)
    if method == "numel":
        return math.prod(shape)
    return None


def _get_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
