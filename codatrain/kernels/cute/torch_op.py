"""Registration of the cute stages as torch custom ops."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def stage_op(name: str, mutates_args: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Register the decorated function as the custom op ``codatrain::<name>`` and return a
    function that calls it.

    The op is *out-style*: it writes its results into tensors its caller allocated, named in
    `mutates_args`, and returns None. Its fake implementation therefore has nothing to do (the
    caller's allocations already give `torch.compile` every output shape), so no op needs a
    hand-written twin that repeats its output shapes.

    Under `torch.compile` the call goes through the op, so Dynamo records one opaque graph node
    and never traces or compiles a kernel. In eager mode it calls the function directly: the
    custom-op dispatcher costs tens of microseconds per call, as much as a small GEMM.
    """

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"codatrain::{name}", fn, mutates_args=mutates_args, device_types="cuda")
        op.register_fake(_writes_only_its_outputs)

        @functools.wraps(fn)
        def call(*args) -> None:
            if torch.compiler.is_compiling():
                op(*args)
            else:
                fn(*args)

        return call

    return wrap


def _writes_only_its_outputs(*args: object) -> None:
    del args
