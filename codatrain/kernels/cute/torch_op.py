"""Registration of the cute stages as torch custom ops."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def stage_op(
    name: str, fake: Callable, mutates_args: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Register the decorated function as the custom op ``codatrain::<name>`` with `fake` as its
    fake implementation (it allocates the outputs only), and return a function that calls it.
    `mutates_args` names the arguments the op writes in place (an accumulating wgrad).

    Under `torch.compile` the call goes through the op, so Dynamo records one opaque graph node
    and never traces or compiles a kernel. In eager mode it calls the function directly: the
    custom-op dispatcher costs tens of microseconds per call, as much as a small GEMM.
    """

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(
            f"codatrain::{name}", fn, mutates_args=mutates_args, device_types="cuda"
        )
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        return call

    return wrap
