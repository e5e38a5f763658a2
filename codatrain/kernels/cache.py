"""Ahead-of-time compilation of the CuTeDSL kernels a training config launches, into a cache
directory that training jobs load them from (docs/design.md §4).

The kernels are known before training starts: which ones depends on the model widths, the
micro-batch (FlashAttention 4 picks its variant from batch and sequence length) and which parts
of the block run as CuTeDSL kernels (`KernelShapes`), never on the depth. `precompile` compiles
them for Hopper (sm_90a) in separate processes that see no GPU, so a CPU machine or CI can build
the cache; those processes run `codatrain.kernels.cute.compile_specs`, which holds the compile specs.
This module imports nothing of the cute side.

A cache directory holds:

    manifest.json  what it was built for: the stamp (Python, nvidia-cutlass-dsl, quack-kernels,
                   flash-attn-4 and apache-tvm-ffi versions, a hash of codatrain's kernel sources,
                   the target GPU) and the `KernelShapes` of every config compiled into it
    quack/         QuACK's .o cache (QUACK_CACHE_DIR): the GEMM stages and codatrain's own kernels
    fa4/           FlashAttention 4's .o cache (FLASH_ATTENTION_CUTE_DSL_CACHE_DIR)

QuACK and FA4 already file their objects under a fingerprint of their sources and versions, so
an object built by other versions is never loaded; but they then compile again, silently, in the
middle of a training job. The manifest makes that visible: `cache_problems` says why a cache
does not fit a config, and a training job (`codatrain.train.kernel_cache`) rebuilds it or stops with that
message, as `kernels.on_stale` says.

The object files hold code for one Python minor version (QuACK's fingerprint includes it): build
the cache with the Python the training job runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

# The compile target: Hopper with its arch-specific instructions (wgmma, TMA), as on H100 / H200.
TARGET_ARCH = "sm_90a"
# SMs of an H100 SXM or H200. FA4 picks its kernel variant from the SM count, so a cache is built
# for one count; a training job on another Hopper part rebuilds for its own.
HOPPER_SMS = 132

MANIFEST = "manifest.json"
# Bump when the manifest layout changes: an old manifest then reads as stale.
MANIFEST_FORMAT = 1
_PACKAGES = ("nvidia-cutlass-dsl", "quack-kernels", "flash-attn-4", "apache-tvm-ffi")
_KERNEL_SOURCES = Path(__file__).resolve().parent / "cute"
_REPO_ROOT = Path(__file__).resolve().parents[2]


class KernelCacheError(ValueError):
    """A kernel cache that does not fit the run (with kernels.on_stale=fail), or a failed build.
    A ValueError, like other bad input: scripts/train.py reports it in one line."""


# ---- what a config compiles ---------------------------------------------------------------------


@dataclass(frozen=True)
class KernelShapes:
    """Everything that decides which kernels a training config launches.

    Model widths, the micro-batch (FA4's variant depends on batch and sequence length; the GEMMs
    compile for any M), which parts of the block run as CuTeDSL kernels: `stages` (the CODA
    stages on the cute backend) and `fa4` (attention), as `codatrain.kernels.resolve` resolved
    them, and `documents` (data.keep_document_boundaries: FA4 runs its variable-length kernels
    instead; the stages do not change), `qkv_bias` (the QKV GEMM and the RoPE backward take
    their bias variants) and `qk_norm` (Qwen3: the QK-norm variants of both). Depth does not
    matter: every layer launches the same kernels.

    With block.precision=fp8 on the cute stages (`fp8`), the layer GEMMs run on FP8 operands and
    quantize passes write those operands: `fp8_grad_format` is the gradients' FP8 format (the
    backward GEMMs' A operands and the gradients' quantize passes), `fp8_wgrad` whether the weight
    gradients' operands are quantized too, into both orientations. Delayed and current scaling
    take different kernels where h leaves F1/F3 (in FP8, or in the activation dtype and then
    quantized); every run launches both (current scaling in its first step), so neither is a field.
    """

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    batch: int
    seq_len: int
    stages: bool = True
    fa4: bool = True
    documents: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    precision: str = "bf16"  # or "fp8" (block.precision), only with `stages`
    fp8_grad_format: str = "e5m2"  # block.fp8_grad_format: "e5m2" or "e4m3"
    fp8_wgrad: bool = False  # block.fp8_wgrad
    fp8_fast_accum: bool = False  # block.fp8_fast_accum

    @property
    def fp8(self) -> bool:
        """Whether the CODA layer GEMMs run on FP8 operands (block.precision=fp8 on the cute stages)."""
        return self.stages and self.precision == "fp8"

    @property
    def any(self) -> bool:
        """Whether the config launches any CuTeDSL kernel at all."""
        return self.stages or self.fa4

    @property
    def key(self) -> str:
        parts = [
            f"d{self.dim}", f"heads{self.n_heads}/{self.n_kv_heads}x{self.head_dim}",
            f"ffn{self.ffn_dim}", f"vocab{self.vocab_size}", f"batch{self.batch}x{self.seq_len}",
        ]
        parts += [name for name in ("stages", "fa4") if getattr(self, name)]
        if self.stages and self.qkv_bias:
            parts.append("qkv_bias")
        if self.stages and self.qk_norm:
            parts.append("qk_norm")
        if self.fp8:
            parts += ["fp8", f"grads_{self.fp8_grad_format}", *(["fp8_wgrad"] if self.fp8_wgrad else []),
                      *(["fp8_fast_accum"] if self.fp8_fast_accum else [])]
        if self.fa4 and self.documents:
            parts.append("documents")
        return " ".join(parts)


# ---- the stamp and the manifest -----------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def kernel_source_hash() -> str:
    """sha256 of codatrain's kernel sources (the same files QuACK adds to its fingerprint)."""
    h = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCES.rglob("*.py")):
        h.update(path.relative_to(_KERNEL_SOURCES).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_stamp(num_sms: int = HOPPER_SMS) -> dict[str, object]:
    """What a cache built now, by this Python, is valid for. Any difference means stale."""
    return {
        "format": MANIFEST_FORMAT,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        **{package: _version(package) for package in _PACKAGES},
        "codatrain kernel sources": kernel_source_hash(),
        "target": TARGET_ARCH,
        "sms": num_sms,
    }


def read_manifest(cache_dir: str | Path) -> dict | None:
    path = Path(cache_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_manifest(cache_dir: Path, manifest: dict) -> None:
    # Written whole and renamed into place: a reader never sees half a manifest.
    staging = cache_dir / f".{MANIFEST}.{os.getpid()}"
    staging.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(staging, cache_dir / MANIFEST)


def cache_problems(cache_dir: str | Path, shapes: KernelShapes, num_sms: int = HOPPER_SMS) -> list[str]:
    """Why `cache_dir` does not hold the kernels of `shapes` for this software (empty: it does)."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        return [f"{Path(cache_dir) / MANIFEST} is missing or unreadable: the cache was never built"]
    built, now = manifest.get("stamp", {}), cache_stamp(num_sms)
    problems = [
        f"{name}: built for {built.get(name)!r}, this job has {value!r}"
        for name, value in now.items()
        if built.get(name) != value
    ]
    if not problems and shapes.key not in manifest.get("configs", {}):
        known = "; ".join(manifest.get("configs", {})) or "none"
        problems.append(f"not built for this config ({shapes.key}); built for: {known}")
    return problems


# ---- building a cache ---------------------------------------------------------------------------


def runtime_env(cache_dir: str | Path) -> dict[str, str]:
    """Environment that points QuACK's and FA4's persistent caches into `cache_dir`."""
    cache_dir = Path(cache_dir).resolve()
    return {
        "QUACK_CACHE_DIR": str(cache_dir / "quack"),
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache_dir / "fa4"),
    }


def compile_env(cache_dir: Path, num_sms: int) -> dict[str, str]:
    """The environment of a process that compiles kernels for Hopper into `cache_dir` without a GPU
    (CuTeDSL reads it when first imported, so it is a new process's)."""
    env = dict(os.environ)
    env.update(runtime_env(cache_dir))
    env.update(
        # Compile for Hopper without asking a GPU: CuTeDSL's target, QuACK's and FA4's kernel choice.
        CUTE_DSL_ARCH=TARGET_ARCH,
        QUACK_ARCH="90",
        FLASH_ATTENTION_ARCH="sm_90",
        FLASH_ATTENTION_NUM_SMS=str(num_sms),
        # The compile processes never touch a GPU, even on a GPU machine: a cache is the same
        # wherever it was built.
        CUDA_VISIBLE_DEVICES="",
        # The compile processes import this codatrain, installed or not.
        PYTHONPATH=os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p),
    )
    return env


@contextlib.contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    """Exclusive use of `cache_dir` for a check-and-build, across processes (and nodes sharing a
    file system): a second job waits for the first build and then finds the cache ready."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class PrecompileReport:
    cache_dir: Path
    shapes: KernelShapes
    kernels: dict[str, float]  # kernel spec name -> seconds its compile (or cache load) took
    seconds: float  # wall time of the whole build


def default_jobs() -> int:
    """Compile processes to run at once: one per core, at most 8. Each imports torch, CuTeDSL,
    QuACK and FA4 (about 5 s and 1 GB of memory) before it compiles its share of the kernels."""
    return max(1, min(8, os.cpu_count() or 1))


def precompile(
    shapes: KernelShapes,
    cache_dir: str | Path,
    *,
    num_sms: int = HOPPER_SMS,
    jobs: int | None = None,
    log: Callable[[str], None] = print,
) -> PrecompileReport:
    """Compile every kernel of `shapes` for sm_90a into `cache_dir`, and record it in the manifest.

    Kernels already in the cache are loaded, not compiled again; a cache built for other versions
    or sources is emptied first. The compiling happens in `jobs` child processes that see no GPU
    (this process imports no CUDA-side package); they print their progress to stderr.
    Raises KernelCacheError when a kernel fails to compile.
    """
    if jobs is not None and jobs < 0:  # no worker: a manifest that records kernels never compiled
        raise ValueError(f"precompile: jobs must be positive (0 or None: one per core), got {jobs}")
    cache_dir = Path(cache_dir).resolve()
    with _locked(cache_dir):
        return _build(shapes, cache_dir, num_sms, jobs or default_jobs(), log)


def _build(
    shapes: KernelShapes, cache_dir: Path, num_sms: int, jobs: int, log: Callable[[str], None]
) -> PrecompileReport:
    stamp = cache_stamp(num_sms)
    manifest = read_manifest(cache_dir)
    if manifest is None or manifest.get("stamp") != stamp:
        # Objects of other versions are never loaded again (the libraries file them under another
        # fingerprint), so they only take space.
        for sub in ("quack", "fa4"):
            shutil.rmtree(cache_dir / sub, ignore_errors=True)
        manifest = {"stamp": stamp, "configs": {}}
    start = time.perf_counter()
    log(f"precompile: {shapes.key} for {TARGET_ARCH} ({num_sms} SMs) into {cache_dir}, {jobs} processes")
    reports = [cache_dir / f".report.{os.getpid()}.{part}.json" for part in range(jobs)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "codatrain.kernels.cute.compile_specs", "--shapes",
             json.dumps(dataclasses.asdict(shapes)), "--part", f"{part}/{jobs}", "--report", str(report)],
            env=compile_env(cache_dir, num_sms),
        )
        for part, report in enumerate(reports)
    ]
    failed = [part for part, worker in enumerate(workers) if worker.wait() != 0]
    # Worker p compiled specs p, p + jobs, p + 2·jobs, …: interleave the reports back into order.
    ordered: list[tuple[int, str, float]] = []
    for part, report in enumerate(reports):
        if report.exists():
            compiled = json.loads(report.read_text())
            ordered += [(i * jobs + part, name, seconds) for i, (name, seconds) in enumerate(compiled)]
            report.unlink()
    kernels = {name: seconds for _, name, seconds in sorted(ordered)}
    if failed:
        raise KernelCacheError(
            f"precompile: compile process(es) {failed} of {jobs} failed; their errors are above"
        )
    seconds = time.perf_counter() - start
    manifest["configs"][shapes.key] = {
        "shapes": dataclasses.asdict(shapes),
        "kernels": list(kernels),
        "seconds": round(seconds, 1),
        "built": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    _write_manifest(cache_dir, manifest)
    log(f"precompile: {len(kernels)} kernel specs ready in {seconds:.1f} s")
    return PrecompileReport(cache_dir, shapes, kernels, seconds)


def ensure_cache(
    cache_dir: str | Path,
    shapes: KernelShapes,
    *,
    on_stale: str,
    num_sms: int = HOPPER_SMS,
    build: bool = True,
    log: Callable[[str], None] = print,
) -> None:
    """Make sure `cache_dir` holds the kernels of `shapes` for this software.

    When it does not (`cache_problems`): on_stale="fail" raises KernelCacheError naming every
    difference; on_stale="rebuild" builds it (when `build`; the caller then waits for the
    process that does).
    """
    cache_dir = Path(cache_dir).resolve()
    problems = cache_problems(cache_dir, shapes, num_sms)
    if not problems:
        log(f"kernel cache: {cache_dir} holds the kernels of this run ({shapes.key})")
        return
    if on_stale == "fail":
        raise KernelCacheError(
            f"kernel cache {cache_dir} does not fit this run (kernels.on_stale=fail):\n  "
            + "\n  ".join(problems)
            + "\nBuild it with scripts/precompile.py and this run's overrides (kernels.cache_dir "
            "included), or set kernels.on_stale=rebuild."
        )
    log("kernel cache: rebuilding, " + "; ".join(problems))
    if build:
        with _locked(cache_dir):
            # Another job (or node) may have built it while this one waited for the lock.
            if cache_problems(cache_dir, shapes, num_sms):
                _build(shapes, cache_dir, num_sms, default_jobs(), log)


def point_libraries_at(cache_dir: str | Path) -> None:
    """Set QuACK's and FA4's cache directories, before either is imported if possible."""
    cache_dir = Path(cache_dir).resolve()
    os.environ.update(runtime_env(cache_dir))
    quack_cache = sys.modules.get("quack.cache")
    if quack_cache is not None:
        # QuACK reads its cache directory at each compile, so a late change still takes effect.
        quack_cache.CACHE_DIR = os.environ["QUACK_CACHE_DIR"]
    fa4 = sys.modules.get("flash_attn.cute.cache_utils")
    fa4_dir = os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"]
    if fa4 is not None and (fa4.CUTE_DSL_CACHE_ENABLED, fa4.CUTE_DSL_CACHE_DIR) != (True, fa4_dir):
        # FA4 opens its caches when it is imported; they cannot be moved afterwards.
        raise KernelCacheError(
            "flash_attn.cute was imported before the kernel cache was set up, so its kernels would "
            f"not come from {cache_dir}; set up the Trainer before importing it"
        )
