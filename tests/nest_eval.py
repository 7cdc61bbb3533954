"""A brute-force reference interpreter of loop-nest statements, for tests.

It walks every point of a statement's domain and applies the statement through its
accesses with numpy, so a builder's accesses are checked against numpy's own result.
Semantics: ``copy`` statements assign ``out[w] = in[r]``; ``mac``/``pool``/``reduce`` statements
accumulate ``out[w] += prod(in_i[r_i])``; ``map`` statements assign ``out[w] = f(in_i[r_i]...)``.
Reads outside a tensor are zero padding; writes outside it are cropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from polyparallel.ir import LoopNest, Statement


def _read(arr: np.ndarray, idx: tuple[int, ...]) -> float:
    if any(i < 0 or i >= n for i, n in zip(idx, arr.shape)):
        return 0.0
    return arr[idx]


def points(nest: LoopNest, st: Statement):
    ext = [range(nest.dim(d).extent) for d in st.dims]
    for p in itertools.product(*ext):
        env = dict(zip(st.dims, p))
        if all(c.eval(env) >= 0 for c in st.constraints):
            yield env


def run(nest: LoopNest, operands: dict[str, np.ndarray], outputs: dict[str, tuple[int, ...]],
        fn: Callable[..., float] | None = None) -> dict[str, np.ndarray]:
    env_arrays = dict(operands)
    for name, shape in outputs.items():
        env_arrays[name] = np.zeros(shape)
    for st in nest.statements:
        if not st.reads:
            continue  # a zero fill: outputs start at zero
        for env in points(nest, st):
            vals = [_read(env_arrays[a.operand], tuple(e.eval(env) for e in a.index)) for a in st.reads]
            for w in st.writes:
                idx = tuple(e.eval(env) for e in w.index)
                if any(i < 0 or i >= n for i, n in zip(idx, env_arrays[w.operand].shape)):
                    continue  # cropped (a transposed convolution's padding)
                if st.name in ("mac", "pool", "reduce"):
                    env_arrays[w.operand][idx] += float(np.prod(vals))
                elif st.name == "map" and fn is not None:
                    env_arrays[w.operand][idx] = fn(*vals)
                else:
                    env_arrays[w.operand][idx] = vals[0]
    return {k: env_arrays[k] for k in outputs}
