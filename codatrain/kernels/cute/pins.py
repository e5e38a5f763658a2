"""Every private name of QuACK, FlashAttention 4 and torch that the cute backend uses, in one place.

These are not the libraries' public API (`_`-names, module attributes patched or read), which is
why pyproject.toml pins quack-kernels, flash-attn-4 and nvidia-cutlass-dsl to exact versions. A
release may move or drop any of them: the cute modules reach them only through this module, so
a version bump fails here, at import, with an ImportError that names the pin and the version
installed. `tests/test_layering.py` checks that no other cute module imports a private name.

- RoPE's sine and cosine in turns (QuACK's rotary epilogue), FA4's backward entry point, the
  implementation behind QuACK's RMSNorm-backward op, torch's FakeTensorMode and FP8 GEMM.
- `compile_only`: compiling for a Hopper GPU that is not there, by patching QuACK's launch and
  cluster-count functions, every `jit_cache` compile function's launcher, its epilogue `Scalar`'s
  device check and its `gemm_add_inplace` op; `skipping_lce_glue`: QuACK's linear cross-entropy
  without its Triton glue.
- `jit_compilers`, `fa4_caches`, `kernel_counts`: what a process compiled, read from QuACK's
  `jit_cache` wrappers and FA4's compile caches.
- `FastAccumEpiMod`: a QuACK epilogue GEMM with FP8 fast accumulation, through the attribute of
  QuACK's SM90 GEMM object that chooses its FP8 mainloop.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import quack.cute_dsl_utils
import quack.epilogue.ops
import quack.gemm_interface
import quack.gemm_sm90
import quack.gemm_tvm_ffi_utils
import quack.linear_cross_entropy
import torch
from quack.cache import CacheInfo
from quack.epilogue.frontend import EpiMod


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
# The function behind QuACK's `rmsnorm_bwd_f` custom op (under FakeTensorMode the op itself runs
# its fake, which compiles nothing).
rmsnorm_bwd_impl = private_name("quack.rmsnorm", "_rmsnorm_bwd_f", QUACK)._init_fn
FakeTensorMode = private_name("torch._subclasses.fake_tensor", "FakeTensorMode", "torch")
# cuBLAS's FP8 GEMM with per-tensor (or per-row) scales: torch has no public FP8 matmul.
scaled_mm = private_name("torch", "_scaled_mm", "torch")

# QuACK's SM90 GEMM adds an FP8 mainloop's WGMMA accumulator into a second, fp32 one after every
# k-tile unless this attribute of the GEMM object is False (fast accumulation: the sum stays in the
# WGMMA accumulator, whose adder keeps about 14 bits, DeepSeek-V3 §3.3.2). No public switch reaches
# it for an epilogue GEMM; `EpiMod.gemm`'s `post_init_attrs` sets it before the trace.
_FP8_SLOW_ACCUM = "fp8_slow_accum"
if f"self.{_FP8_SLOW_ACCUM} =" not in inspect.getsource(quack.gemm_sm90.GemmSm90.__init__):
    raise ImportError(f"quack.gemm_sm90.GemmSm90.{_FP8_SLOW_ACCUM}, a private name of {QUACK} that "
                      f"codatrain uses, is gone; codatrain pins {pinned(QUACK)}, and {QUACK} "
                      f"{installed(QUACK)} is installed")


class FastAccumEpiMod(EpiMod):
    """A QuACK epilogue GEMM (as `quack.epilogue.frontend.gemm_epilogue` builds) whose FP8 mainloop
    runs on fast accumulation: one accumulator per thread instead of two, which pingpong tiles
    need. The attribute is part of QuACK's compile keys, so it is a kernel of its own."""

    def gemm(self, *args: Any, post_init_attrs: tuple = (), **kwargs: Any) -> Any:
        return super().gemm(*args, post_init_attrs=(*post_init_attrs, (_FP8_SLOW_ACCUM, False)), **kwargs)


@contextlib.contextmanager
def compile_only(num_sms: int) -> Iterator[list[object]]:
    """Trace and compile for a Hopper GPU that need not be there, launching nothing. Yields the
    list of the QuACK launch plans whose launch it skipped so far.

    - Tensors are fake (FakeTensorMode): real shapes, strides and dtypes, no memory, no driver.
    - QuACK sends every GEMM launch through `launch_gemm`, which does nothing here. Every other
      kernel is launched by calling what its `jit_cache` compile function returned: here those
      functions compile (or load) as usual and return a launcher that does nothing, so a caller
      runs a stage's own Python path and compiles exactly the keys a training job asks for.
    - QuACK's `gemm_add_inplace` calls its torch custom op even in eager mode, and under
      FakeTensorMode that op runs its fake, which compiles nothing: here it calls the op's own
      implementation directly, as QuACK's eager paths do for its other ops.
    - QuACK's epilogue `Scalar` operands given as tensors (an FP8 GEMM's 1/(s_a·s_b), F1/F3's h
      scale) must be CUDA tensors. Here a tensor on another device passes the check as its CUDA
      twin would, so stage inputs can be fake CPU tensors like the rest: QuACK keys the kernel
      on the scalar's dtype and on its being a pointer, never on its device.
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
        for owner, attr, compiler in _compiler_references():
            launch_nothing = _launching_nothing(compiler)
            if isinstance(owner, type):  # a kernel class's static compile method
                launch_nothing = staticmethod(launch_nothing)
            stack.enter_context(mock.patch.object(owner, attr, launch_nothing))
        scalar = quack.epilogue.ops.Scalar
        validate_scalar = scalar._validate_pointer_value

        def validate_as_cuda(self: object, value: object) -> None:
            if isinstance(value, torch.Tensor) and not value.is_cuda:
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
            validate_scalar(self, value)

        stack.enter_context(mock.patch.object(scalar, "_validate_pointer_value", validate_as_cuda))
        add_inplace = quack.gemm_interface.gemm_add_inplace_op._init_fn
        stack.enter_context(mock.patch.object(quack.gemm_interface, "gemm_add_inplace_op", add_inplace))
        stack.enter_context(FakeTensorMode())
        yield skipped


@contextlib.contextmanager
def skipping_lce_glue() -> Iterator[None]:
    """QuACK's linear cross-entropy (inside `compile_only`) with the Triton glue of its scaled-exp
    pipeline skipped: Triton cannot even trace without a GPU driver, and compiles it at the first
    launch into its own cache."""
    with mock.patch.object(quack.linear_cross_entropy, "lce_glue", lambda *args, **kwargs: None):
        yield


# ---- what a process compiled ----------------------------------------------------------------------


def _compiler_references() -> list[tuple[object, str, Callable]]:
    """(owner, attribute, compile function) for every reference to a QuACK `jit_cache` compile
    function (QuACK's own and codatrain's) in the loaded modules: module attributes, and the static
    compile methods of kernel classes (QuACK's `CrossEntropy.compile`)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "quack" and not name.startswith("codatrain.kernels.cute"):
            continue
        owners = [module, *(m for m in vars(module).values() if isinstance(m, type) and m.__module__ == name)]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                compiler = value.__func__ if isinstance(value, staticmethod) else value
                # A jit_cache wrapper: one kernel per key in `cache`, and QuACK's CacheInfo counts.
                info = getattr(compiler, "cache_info", None)
                if isinstance(getattr(compiler, "cache", None), dict) and callable(info):
                    if isinstance(info(), CacheInfo):
                        found.append((owner, attr, compiler))
    return found


def _launching_nothing(compiler: Callable) -> Callable:
    """`compiler`, whose kernels launch nothing (`compile_only`); it keeps the compiler's cache
    and counts, so `jit_compilers` still finds them."""

    @functools.wraps(compiler)
    def compile_only_launcher(*args: object, **kwargs: object) -> Callable:
        compiler(*args, **kwargs)
        return lambda *args, **kwargs: None

    return compile_only_launcher


def jit_compilers() -> list[Callable]:
    """QuACK's `jit_cache` compile functions (its own and codatrain's) loaded in this process."""
    return list({id(compiler): compiler for _, _, compiler in _compiler_references()}.values())


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


def kernel_counts(since: float) -> tuple[int, int, list[str]]:
    """(kernels loaded from disk, kernels compiled, what compiled: a compile function's name and
    its count, e.g. "CrossEntropy.compile ×2") by this process, started at wall-clock time `since`,
    over QuACK's compile functions and FA4's compile caches."""
    loaded = compiled = 0
    names = []
    for compiler in jit_compilers():
        info = compiler.cache_info()
        loaded += info.currsize - info.misses
        compiled += info.misses
        if info.misses:
            names.append(f"{compiler.__qualname__} ×{info.misses}")
    for cache in fa4_caches():
        # FA4 does not count. With its disk cache on, it exports every kernel it compiles, so
        # this process's compiles are the objects written since it started.
        fresh = len(cache.cache)
        if hasattr(cache, "cache_path"):
            written = sum(path.stat().st_mtime >= since for path in Path(cache.cache_path).glob("*.o"))
            fresh = min(fresh, written)
        compiled += fresh
        loaded += len(cache.cache) - fresh
        if fresh:
            names.append(f"FA4 {Path(getattr(cache, 'cache_path', 'kernel')).name} ×{fresh}")
    return loaded, compiled, names
