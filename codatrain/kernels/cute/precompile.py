"""The CuTeDSL kernels a training config launches, as compile specs, and how to compile them
without a GPU: the compile process that `codatrain.kernels.precompile` (which owns the cache
directory) starts as ``python -m codatrain.kernels.cute.precompile``, and the count of kernels a
training process loaded or compiled (`kernel_counts`).

Each stage family contributes its kernels through one function of `KernelShapes`:
`entry_kernels`, `forward_kernels`, `backward_kernels`, `attention_kernels` (`FAMILIES`). A
`KernelSpec` names a kernel and compiles it from inputs with the training job's shapes, strides
and dtypes, so that its cache key is the key the job looks up:

- GEMM stages are compiled by calling the stage itself (the `CuteStages` method the model calls)
  inside `compile_only`, where QuACK builds the launch plan, compiles or loads the kernel, and
  skips the launch. Whatever tile config or epilogue a stage picks is what gets compiled.
- Kernels that launch their compiled function themselves (entry, the row-wise backward kernels,
  QuACK's rstd reduction) are compiled by calling their tensor-free compile function with the
  arguments their stage derives from its tensors: the stage itself would launch on fake tensors.
- FlashAttention 4 compiles, and skips its launch, by itself under FakeTensorMode.

A new stage with a QuACK GEMM plugs in as one more `KernelSpec` calling it; a kernel that
launches itself, as one calling its compile function.

Importing this module needs the cuda extras. Compiling needs the target set in the environment
before CuTeDSL is first imported (`CUTE_DSL_ARCH`, `QUACK_ARCH`, FA4's `FLASH_ATTENTION_ARCH` and
`FLASH_ATTENTION_NUM_SMS`), as the compile processes started by `codatrain.kernels.precompile`
have it.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import quack.cute_dsl_utils
import quack.gemm_interface
import quack.gemm_tvm_ffi_utils
import quack.linear_cross_entropy
import torch
from flash_attn.cute import flash_attn_func
from flash_attn.cute.interface import BIN_BATCH_SEARCH_THRESH, _flash_attn_bwd
from quack.cache import CacheInfo
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.rmsnorm import _rmsnorm_bwd_f, rmsnorm_fwd
from torch._subclasses.fake_tensor import FakeTensorMode

from codatrain.kernels.attention import Documents, causal_attention
from codatrain.kernels.cute import CuteStages, entry, head, rowwise
from codatrain.kernels.cute.attention import varlen_backward, varlen_forward
from codatrain.kernels.precompile import HOPPER_SMS, KernelShapes
from codatrain.kernels.stages import IGNORE_INDEX, Rope

# Training activations are bf16 (autocast on one GPU, FSDP2's param dtype on several);
# statistics fp32.
ACT = torch.bfloat16
STAT = torch.float32
# RoPE's θ and scaling only fill a frequency table at run time; no kernel depends on them.
_ANY_ROPE = Rope(theta=10000.0)
# Nor on a norm's ε.
_EPS = 1e-5
# One kernel compiles in seconds, FA4's backward in under a minute on a slow core. A spec that
# takes this long is stuck (most likely launching on fake tensors): stop with its traceback.
SPEC_TIMEOUT_S = 600
# Stage inputs are fake CPU tensors: QuACK keys kernels on dtypes, strides and QUACK_ARCH, never
# on the device, and fake CUDA tensors lack some ops (indexing with None, scatter_) on a
# CPU-only torch. FA4 takes fake CUDA tensors: CuTeDSL finds its launch stream through them.
_STAGE_DEVICE = "cpu"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # what it is, for logs and the manifest
    compile: Callable[[], object]  # compiles (or loads) the kernel inside `compile_only`


# ---- fake inputs (created inside compile_only, where they cost no memory) ----------------------


def _act(*shape: int, device: str = _STAGE_DEVICE) -> torch.Tensor:
    return torch.empty(shape, dtype=ACT, device=device)


def _stat(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=STAT, device=_STAGE_DEVICE)


def _index(*shape: int) -> torch.Tensor:
    """Token ids, targets and positions: int64, as the data loader and the model make them."""
    return torch.empty(shape, dtype=torch.int64, device=_STAGE_DEVICE)


def _cute(dtype: torch.dtype) -> type:
    return torch2cute_dtype_map[dtype]


def _tokens(s: KernelShapes) -> int:
    return s.batch * s.seq_len


def _q_dim(s: KernelShapes) -> int:
    return s.n_heads * s.head_dim


def _qkv_dim(s: KernelShapes) -> int:
    return (s.n_heads + 2 * s.n_kv_heads) * s.head_dim


def _head_rows(s: KernelShapes) -> int:
    """Rows per chunk of the LM head, as `CodaLlama` chooses them by default."""
    return CuteStages().head_chunk_rows(s.vocab_size)


# ---- the stage families -----------------------------------------------------------------------


def entry_kernels(s: KernelShapes) -> list[KernelSpec]:
    """Model entry (embedding gather, x ⊙ γ, first rstd) and its backward (embedding gradient)."""
    if not s.stages:
        return []
    tokens = _cute(torch.int64)

    def forward(embedding: torch.dtype) -> Callable[[], object]:
        return lambda: entry.compile_entry(tokens, _cute(embedding), _cute(ACT), _cute(ACT), s.dim)

    return [
        # Under autocast on one GPU the fp32 embedding table is read as it is; under FSDP2 it
        # arrives in bf16. Both are compiled, so one cache serves either launch.
        KernelSpec("entry, fp32 embedding", forward(torch.float32)),
        KernelSpec("entry, bf16 embedding", forward(ACT)),
        KernelSpec("entry backward", lambda: entry.compile_entry_bwd(tokens, _cute(ACT), s.dim)),
    ]


def forward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """F1–F4, the rstd reduction and the LM head of docs/design.md §3 (and the full-logits head)."""
    if not s.stages:
        return []
    st, m, d, vocab = CuteStages(), _tokens(s), s.dim, s.vocab_size
    rope = {"head_dim": s.head_dim, "rope_heads": s.n_heads + s.n_kv_heads, "rope": _ANY_ROPE}

    def out_proj():
        return st.gemm_residual_rms(_act(m, _q_dim(s)), _act(d, _q_dim(s)), _act(m, d), _act(d))

    def down_proj():
        return st.gemm_residual_rms(_act(m, s.ffn_dim), _act(d, s.ffn_dim), _act(m, d), _act(d))

    def rstd_reduce():
        # QuACK's reduction compiles per number of partials, which F1's and F3's column tiles
        # decide (they differ where the two GEMMs tile differently, e.g. at 8B widths).
        for partials in (out_proj().sq_partials, down_proj().sq_partials):
            st.rstd_from_partials(partials, dim=d, eps=_EPS)

    return [
        KernelSpec("F1 out-proj + residual + x² partials", out_proj),
        KernelSpec("F3 down-proj + residual + x² partials", down_proj),
        KernelSpec("R rstd from partials", rstd_reduce),
        KernelSpec(
            "F2 gate/up · rstd + SwiGLU",
            lambda: st.gemm_rstd_swiglu(_act(m, d), _act(2 * s.ffn_dim, d), _stat(m)),
        ),
        KernelSpec(
            "F4 QKV · rstd + RoPE",
            lambda: st.gemm_rstd_rope(_act(m, d), _act(_qkv_dim(s), d), _stat(m), _index(m), **rope),
        ),
        KernelSpec(
            "LM head · rstd + LSE + target logit",
            lambda: st.gemm_rstd_lse(_act(m, d), _act(vocab, d), _stat(m), _index(m)),
        ),
        KernelSpec("LM head · rstd, full logits", lambda: st.gemm_rstd(_act(m, d), _act(vocab, d), _stat(m))),
    ]


def backward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The backward stages, in the order `CodaLlama`'s backward calls them."""
    if not s.stages:
        return []
    st, m, d, f = CuteStages(), _tokens(s), s.dim, s.ffn_dim
    return [
        *head_kernels(s),
        KernelSpec(
            "dSwiGLU in the down-proj dgrad", lambda: st.gemm_dswiglu(_act(m, d), _act(d, f), _act(m, 2 * f))
        ),
        KernelSpec(
            "norm backward + residual gradient in the gate/up and QKV dgrads",
            lambda: st.gemm_rms_bwd(
                _act(m, 2 * f), _act(2 * f, d), _act(m, d), _act(d), _stat(m), _stat(m), _act(m, d)
            ),
        ),
        # rope_bwd and row_dot launch the same row-wise kernel, with and without the rotation.
        KernelSpec("RoPE backward + ZdZ", lambda: rowwise.compile_row_dot(_cute(ACT), _qkv_dim(s), True)),
        KernelSpec(
            "row dot, ZdZ of the full-logits head",
            lambda: rowwise.compile_row_dot(_cute(ACT), s.vocab_size, False),
        ),
    ]


def head_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The training head (`head.lm_head_ce`): QuACK's RMSNorm forward and backward row kernels,
    and the GEMMs (and, on the base pipeline, the cross-entropy row kernel) of its linear
    cross-entropy. The scaled-exp pipeline's two small Triton kernels compile at their first
    launch, into Triton's own disk cache, in about a second. Each spec makes the call `head`
    makes, so the compile keys are the job's."""
    m, d, vocab, rows = _tokens(s), s.dim, s.vocab_size, _head_rows(s)

    def final_norm() -> object:
        return rmsnorm_fwd(_act(m, d), _act(d), eps=_EPS, store_rstd=True)

    def linear_cross_entropy() -> object:
        # Where the scaled-exp pipeline applies, the base one compiles too: a micro-batch whose
        # loss is past its exact range reruns there (head.SCALED_EXP_MAX_LOSS).
        with mock.patch.object(quack.linear_cross_entropy, "lce_glue", lambda *args, **kwargs: None), \
                mock.patch.object(head, "scaled_exp_is_exact", lambda loss: False):
            return head.linear_cross_entropy(_act(m, d), _act(vocab, d), _index(m), rows, IGNORE_INDEX)

    summed, last_rows = head.dweight_parts(m, d, vocab, rows)

    def pending_dweight() -> object:
        # The backward's GEMM of the base pipeline's last chunk (`lm_head_dweight`), scaled by the
        # loss gradient and rounded to the weight's dtype.
        return head.lm_head_dweight(_stat(vocab, d) if summed else None,
                                    head.last_dlogits_like(last_rows, vocab, _act(1)), _act(last_rows, d),
                                    _stat(), ACT)

    def final_norm_backward() -> object:
        # The implementation of the custom op `head` calls (under FakeTensorMode the op itself
        # would run its fake, which compiles nothing); the SM count only sizes an output.
        return _rmsnorm_bwd_f._init_fn(_act(m, d), _act(d), _act(m, d), _stat(m), None, HOPPER_SMS)

    return [
        KernelSpec("final RMSNorm", final_norm),
        KernelSpec("LM head linear cross-entropy, loss and gradients", linear_cross_entropy),
        *([KernelSpec("LM head weight gradient of the last chunk", pending_dweight)] if last_rows else []),
        KernelSpec("final RMSNorm backward", final_norm_backward),
    ]


def attention_kernels(s: KernelShapes) -> list[KernelSpec]:
    """FlashAttention 4, causal, on q/k/v split off the fused QKV output as the model splits it;
    with documents, its variable-length kernels instead."""
    if not s.fa4:
        return []
    if s.documents:
        return _varlen_attention_kernels(s)

    def run(backward: bool) -> Callable[[], object]:
        # The calls of codatrain.kernels.cute.attention (`_fa4_fwd`, `_fa4_bwd`).
        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: None) -> torch.Tensor:
            with torch.no_grad():
                out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
            if backward:
                _flash_attn_bwd(q, k, v, out, torch.empty_like(out), lse, causal=True)
            return out

        return lambda: causal_attention(
            _act(_tokens(s), _qkv_dim(s), device="cuda"), s.batch, s.n_heads, s.n_kv_heads, s.head_dim,
            attention,
        )

    return [KernelSpec("FA4 forward", run(backward=False)), KernelSpec("FA4 backward", run(backward=True))]


def _varlen_attention_kernels(s: KernelShapes) -> list[KernelSpec]:
    """FA4's varlen forward and backward, as `fa4_attention` calls them with `Documents`. FA4 adds
    a batch-lookup aid, a kernel variant of its own, above BIN_BATCH_SEARCH_THRESH sequences: a
    micro-batch with more documents than that (short ones) launches it, so it is compiled too
    when the micro-batch has room for that many."""
    counts = [1] + ([BIN_BATCH_SEARCH_THRESH + 1] if _tokens(s) > BIN_BATCH_SEARCH_THRESH else [])

    def run(backward: bool, count: int) -> Callable[[], object]:
        def attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents
        ) -> torch.Tensor:
            tokens = [t.flatten(0, 1) for t in (q, k, v)]  # as `fa4_attention` flattens them
            out, lse = varlen_forward(*tokens, documents.cu_seqlens, documents.max_seqlen)
            if backward:
                varlen_backward(torch.empty_like(out), *tokens, out, lse, documents.cu_seqlens,
                                documents.max_seqlen)
            return out

        def compile() -> torch.Tensor:
            m = _tokens(s)
            documents = Documents(
                doc_index=_index(s.batch, s.seq_len), max_seqlen=s.seq_len, positions=_index(m),
                cu_seqlens=torch.empty(count + 1, dtype=torch.int32, device="cuda"), block_mask=None,
            )
            return causal_attention(
                _act(m, _qkv_dim(s), device="cuda"), s.batch, s.n_heads, s.n_kv_heads, s.head_dim,
                attention, documents,
            )

        return compile

    return [
        KernelSpec(f"FA4 varlen {direction}, {'up to' if count == 1 else 'over'} "
                   f"{BIN_BATCH_SEARCH_THRESH} documents", run(direction == "backward", count))
        for count in counts for direction in ("forward", "backward")
    ]


FAMILIES: tuple[Callable[[KernelShapes], list[KernelSpec]], ...] = (
    entry_kernels, forward_kernels, backward_kernels, attention_kernels,
)


def kernel_specs(shapes: KernelShapes) -> list[KernelSpec]:
    """Every kernel a training job of `shapes` launches, family by family."""
    return [spec for family in FAMILIES for spec in family(shapes)]


# ---- compiling without a GPU ------------------------------------------------------------------


@contextlib.contextmanager
def compile_only(num_sms: int) -> Iterator[list[object]]:
    """Trace and compile for a Hopper GPU that need not be there, launching nothing. Yields the
    list of the QuACK launch plans whose launch it skipped so far.

    - Tensors are fake (FakeTensorMode): real shapes, strides and dtypes, no memory, no driver.
    - QuACK sends every GEMM launch through `launch_gemm`, which does nothing here. Every other
      kernel is launched by calling what its `jit_cache` compile function returned: here those
      functions compile (or load) as usual and return a launcher that does nothing, so a spec
      runs the stage's own Python path and compiles exactly the keys a training job asks for.
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
        for owner, attr, compiler in _compiler_references():
            launch_nothing = _launching_nothing(compiler)
            if isinstance(owner, type):  # a kernel class's static compile method
                launch_nothing = staticmethod(launch_nothing)
            stack.enter_context(mock.patch.object(owner, attr, launch_nothing))
        add_inplace = quack.gemm_interface.gemm_add_inplace_op._init_fn
        stack.enter_context(mock.patch.object(quack.gemm_interface, "gemm_add_inplace_op", add_inplace))
        stack.enter_context(FakeTensorMode())
        yield skipped


def compile_specs(
    specs: list[KernelSpec], num_sms: int, log: Callable[[str], None] = print
) -> dict[str, float]:
    """Compile `specs` in order; returns {spec name: seconds}.

    Raises (and stops) when a spec raises, or when it reached no kernel at all: its stage then
    takes a path that `compile_only` does not cover, and the training job would compile it.
    """
    seconds = {}
    with compile_only(num_sms) as skipped_launches:
        for i, spec in enumerate(specs, 1):
            start, reached = time.perf_counter(), (_kernel_lookups(), len(skipped_launches))
            faulthandler.dump_traceback_later(SPEC_TIMEOUT_S, exit=True)
            try:
                spec.compile()
            finally:
                faulthandler.cancel_dump_traceback_later()
            if (_kernel_lookups(), len(skipped_launches)) == reached:
                raise RuntimeError(f"kernel spec {spec.name!r} reached no kernel; training would compile it")
            seconds[spec.name] = round(time.perf_counter() - start, 2)
            log(f"{i}/{len(specs)} {spec.name}: {seconds[spec.name]:.1f} s")
    return seconds


def _kernel_lookups() -> int:
    """How often a kernel was fetched from a compile cache so far (compiled, loaded or in memory)."""
    quack_lookups = sum(info.hits + info.misses for info in (c.cache_info() for c in jit_compilers()))
    return quack_lookups + sum(len(cache.cache) for cache in fa4_caches())


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


# ---- the compile process ----------------------------------------------------------------------


def _worker(argv: list[str]) -> None:
    """One compile process: compiles its share (`--part i/n`) of the kernel specs of `--shapes`
    and writes [[spec name, seconds], …] to `--report`. Started by `codatrain.kernels.precompile`
    with the environment of its `_compile_env`, which CuTeDSL read when it was first imported."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--part", required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args(argv)
    part, parts = (int(x) for x in args.part.split("/"))
    shapes = KernelShapes(**json.loads(args.shapes))

    # Known noise of compiling on fake tensors: FA4 reads data pointers (of fakes, harmlessly) and
    # hands CuTeDSL an argument it cannot type (it is compile-time).
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    warnings.filterwarnings("ignore", message="Argument aux_data")

    def log(line: str) -> None:
        print(f"precompile [{part}/{parts}] {line}", file=sys.stderr, flush=True)

    specs = kernel_specs(shapes)[part::parts]
    seconds = compile_specs(specs, int(os.environ["FLASH_ATTENTION_NUM_SMS"]), log)
    Path(args.report).write_text(json.dumps(list(seconds.items())))


if __name__ == "__main__":
    _worker(sys.argv[1:])
