"""Every private name of QuACK, FlashAttention 4 and torch that the cute backend uses, in one place.

These are not the libraries' public API (`_`-names, module attributes patched or read), which is
why pyproject.toml pins quack-kernels, flash-attn-4 and nvidia-cutlass-dsl to exact versions. A
release may move or drop any of them: the cute modules reach them only through this module, so
a version bump fails here, at import, with an ImportError that names the pin and the version
installed. `tests/test_layering.py` checks that no other cute module imports a private name.

- RoPE's sine and cosine in turns (QuACK's rotary epilogue), FA4's backward entry point, QuACK's
  tensor-free RMSNorm compile functions and their T bucketing, torch's FakeTensorMode.
- `compile_only`: compiling for a Hopper GPU that is not there, by patching QuACK's launch and
  cluster-count functions and unwrapping its `gemm_add_inplace` op;
  `linear_cross_entropy_compile_only`: the same for QuACK's linear cross-entropy glue.
- `jit_compilers`, `fa4_caches`, `kernel_counts`: what a process compiled, read from QuACK's
  `jit_cache` wrappers and FA4's compile caches.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import quack.cute_dsl_utils
import quack.gemm_interface
import quack.gemm_tvm_ffi_utils
import quack.linear_cross_entropy
from quack.cache import CacheInfo


def pinned(package: str) -> str:
    """The requirement codatrain pins `package` to (pyproject.toml), as installed."""
    try:
        requirements = importlib.metadata.requires("codatrain") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        if requirement.split(";")[0].replace(" ", "").startswith(package):
            return requirement.split(";")[0].strip()
    return f"{package} (pyproject.toml)"


def installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def private_name(module: str, name: str, package: str) -> Any:
    """`module.name`, a private name of `package`; ImportError naming the pin when it is gone."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"{module}.{name}, a private name of {package} that codatrain uses, is gone ({error}); "
            f"codatrain pins {pinned(package)}, and {package} {installed(package)} is installed"
        ) from None


QUACK, FA4 = "quack-kernels", "flash-attn-4"
sincos_turns = private_name("quack.epilogue.rotary", "_sincos_turns", QUACK)
flash_attn_bwd = private_name("flash_attn.cute.interface", "_flash_attn_bwd", FA4)
compile_rms_final_reduce = private_name("quack.rms_final_reduce", "_compile_rms_final_reduce", QUACK)
compile_rmsnorm_fwd = private_name("quack.rmsnorm", "_compile_rmsnorm_fwd", QUACK)
compile_rmsnorm_bwd = private_name("quack.rmsnorm", "_compile_rmsnorm_bwd", QUACK)
bucket_t_hint = private_name("quack.rmsnorm", "_bucket_T_hint", QUACK)
FakeTensorMode = private_name("torch._subclasses.fake_tensor", "FakeTensorMode", "torch")


@contextlib.contextmanager
def compile_only(num_sms: int) -> Iterator[list[object]]:
    """Trace and compile for a Hopper GPU that need not be there, launching nothing. Yields the
    list of the QuACK launch plans whose launch it skipped so far.

    - Tensors are fake (FakeTensorMode): real shapes, strides and dtypes, no memory, no driver.
    - QuACK sends every GEMM launch through `launch_gemm`, which does nothing here.
    - QuACK's `gemm_add_inplace` calls its torch custom op even in eager mode, and under
      FakeTensorMode that op runs its fake, which compiles nothing: here it calls the op's own
      implementation directly, as QuACK's eager paths do for its other ops.
    - QuACK asks the driver how many clusters fit on the GPU (`get_max_active_clusters`) to size
      the persistent grid of a launch plan. Here the target answers instead: a Hopper GEMM CTA
      fills an SM, so num_sms // cluster_size clusters (66 of 2 CTAs on a 132-SM H100 SXM or
      H200). The number only sizes the grid of a launch that never happens; no compiled kernel
      depends on it.
    """
    launch = quack.gemm_tvm_ffi_utils.launch_gemm
    clusters = quack.cute_dsl_utils.get_max_active_clusters
    skipped: list[object] = []

    def skip_launch(plan: object, *args: object, **kwargs: object) -> None:
        del args, kwargs
        skipped.append(plan)

    def target_clusters(cluster_size: int, *args: object, **kwargs: object) -> int:
        del args, kwargs
        return num_sms // cluster_size

    with contextlib.ExitStack() as stack:
        # QuACK's modules import both functions by name: replace every module's reference.
        quack_modules = [module for name, module in sys.modules.items() if name.split(".")[0] == "quack"]
        for module in quack_modules:
            for attr, value in list(vars(module).items()):
                if value is launch:
                    stack.enter_context(mock.patch.object(module, attr, skip_launch))
                elif value is clusters:
                    stack.enter_context(mock.patch.object(module, attr, target_clusters))
        add_inplace = quack.gemm_interface.gemm_add_inplace_op._init_fn
        stack.enter_context(mock.patch.object(quack.gemm_interface, "gemm_add_inplace_op", add_inplace))
        stack.enter_context(FakeTensorMode())
        yield skipped


@contextlib.contextmanager
def linear_cross_entropy_compile_only(compile_cross_entropy: Callable) -> Iterator[None]:
    """QuACK's linear cross-entropy (inside `compile_only`) with its glue kernel skipped and its
    cross-entropy row kernel compiled by `compile_cross_entropy`, which takes the arguments of
    `cross_entropy_fwd_out`, instead of launched on fake tensors."""
    lce = quack.linear_cross_entropy
    with mock.patch.object(lce, "lce_glue", lambda *args, **kwargs: None), \
            mock.patch.object(lce, "cross_entropy_fwd_out", compile_cross_entropy):
        yield


# ---- what a process compiled ----------------------------------------------------------------------


def jit_compilers() -> list[Callable]:
    """QuACK's `jit_cache` compile functions (its own and codatrain's) loaded in this process."""
    found: dict[int, Callable] = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "quack" or name.startswith("codatrain.kernels.cute"):
            for value in list(vars(module).values()):
                # A jit_cache wrapper: one kernel per key in `cache`, and QuACK's CacheInfo counts.
                info = getattr(value, "cache_info", None)
                if isinstance(getattr(value, "cache", None), dict) and callable(info):
                    if isinstance(info(), CacheInfo):
                        found[id(value)] = value
    return list(found.values())


def fa4_caches() -> list:
    """FA4's compile caches (one per kernel kind: forward, backward, their helpers), if loaded."""
    fa4 = sys.modules.get("flash_attn.cute.interface")
    if fa4 is None:
        return []
    caches = (getattr(value, "compile_cache", None) for value in list(vars(fa4).values()))
    return list({id(cache): cache for cache in caches if cache is not None}.values())


def kernel_lookups() -> int:
    """How often a kernel was fetched from a compile cache so far (compiled, loaded or in memory)."""
    quack_lookups = sum(info.hits + info.misses for info in (c.cache_info() for c in jit_compilers()))
    return quack_lookups + sum(len(cache.cache) for cache in fa4_caches())


def kernel_counts(since: float) -> tuple[int, int]:
    """(kernels loaded from disk, kernels compiled) by this process, started at wall-clock time
    `since`, over QuACK's compile functions and FA4's compile caches."""
    loaded = compiled = 0
    for compiler in jit_compilers():
        info = compiler.cache_info()
        loaded += info.currsize - info.misses
        compiled += info.misses
    for cache in fa4_caches():
        # FA4 does not count. With its disk cache on, it exports every kernel it compiles, so
        # this process's compiles are the objects written since it started.
        fresh = len(cache.cache)
        if hasattr(cache, "cache_path"):
            written = sum(path.stat().st_mtime >= since for path in Path(cache.cache_path).glob("*.o"))
            fresh = min(fresh, written)
        compiled += fresh
        loaded += len(cache.cache) - fresh
    return loaded, compiled
