"""Precompiled CuTeDSL kernels (codatrain/kernels/cache.py, codatrain/train/kernel_cache.py,
scripts/precompile.py).

The stamp, manifest and stale-cache switch run anywhere. With the cuda extras installed (CuTeDSL,
QuACK, FA4, triton), `test_precompile_tiny_for_sm90a` builds the cache of the `tiny` config for
sm_90a on this CPU machine: every stage kernel and FA4 traces and compiles without a GPU
(a minute or two per build on two cores), and `test_precompile_fp8_for_sm90a` the FP8 kernels of
block.precision=fp8 in both block.fp8_wgrad modes; without them they are skipped.
"""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from codatrain.config import load_config, validate
from codatrain.kernels.cache import (
    HOPPER_SMS,
    MANIFEST,
    KernelCacheError,
    KernelShapes,
    cache_problems,
    cache_stamp,
    compile_env,
    ensure_cache,
    precompile,
    read_manifest,
)
from codatrain.train.distributed import DistInfo
from codatrain.train.kernel_cache import KernelCache, process_age_s
from codatrain.train.plan import build_run_plan

REPO = Path(__file__).resolve().parent.parent
CODA_KERNELS = ["block=coda", "block.backend=cute", "block.attention=fa4"]
CUDA_EXTRAS = ("cutlass", "quack", "flash_attn", "triton")
# A vocabulary that is not a multiple of 8, and an F1 and F3 that tile differently (K ≤ N and K > N).
ODD_SHAPES = ["model.vocab_size=509", "model.dim=384", "model.ffn_dim=1024"]
QKV_BIAS = ["model.family=qwen2", "model.qkv_bias=true"]
QK_NORM = ["model.family=qwen3", "model.qk_norm=true"]
DOCUMENTS = ["data.keep_document_boundaries=true"]
# The FP8 layer GEMMs on the cute stages; with SDPA, as the FP8 kernels do not touch attention
# (FA4's kernels are the bf16 builds' to check).
FP8 = ["block.precision=fp8"]
FP8_STAGES = ["block=coda", "block.backend=cute", "block.attention=sdpa", *FP8]
FA4_FIXED = ["FA4 forward", "FA4 backward"]
# Both with up to and over 256 documents per micro-batch (FA4's two variants).
FA4_VARLEN = [f"FA4 varlen {direction}, {count} 256 documents"
              for count in ("up to", "over") for direction in ("forward", "backward")]


def run_config(overrides: list[str]):
    cfg = load_config(overrides)
    validate(cfg)
    return OmegaConf.to_object(cfg)


def shapes_of(overrides: list[str], device: torch.device | None = None) -> KernelShapes:
    """The kernels of a run config on `device` (None: the precompile target), as the training job
    and scripts/precompile.py plan them."""
    return build_run_plan(run_config(overrides), device).kernel_shapes


def tiny_shapes() -> KernelShapes:
    return shapes_of(CODA_KERNELS)


def write_manifest(cache_dir: Path, shapes: KernelShapes, **stamp_changes) -> None:
    """A manifest as scripts/precompile.py writes it, for this software unless `stamp_changes`."""
    stamp = {**cache_stamp(), **stamp_changes}
    (cache_dir / MANIFEST).write_text(json.dumps({"stamp": stamp, "configs": {shapes.key: {}}}))


def fake_job(cache_dir: Path, shapes: KernelShapes) -> dict:
    """What a micro-step of a job of `shapes` would load from `cache_dir` and compile
    (tests/fake_job.py, in a compile process's environment): {"loaded", "compiled", "names"}."""
    job = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fake_job.py"), json.dumps(dataclasses.asdict(shapes))],
        env=compile_env(cache_dir, HOPPER_SMS), capture_output=True, text=True, timeout=600,
    )
    assert job.returncode == 0, job.stderr[-5000:]
    return json.loads(job.stdout.splitlines()[-1])


def precompile_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "precompile.py"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )


@pytest.mark.parametrize("overrides, refusal", [
    (["model.ffn_dim=380"],
     r"^model.ffn_dim=380 does not run on block.backend=cute: .* \(nearest: 376 or 384\)$"),
    (["model.n_heads=2", "model.n_kv_heads=1", "model.dim=100"],
     r"^model.dim=100 does not run on block.backend=cute: .*multiple of 8 \(nearest: 96 or 104\)$"),
    (["model.n_heads=8", "model.n_kv_heads=2", "model.dim=160"],
     r"^model.head_dim=20 does not run on block.backend=cute"),
    (["model.dim=1024", "model.n_heads=2", "model.n_kv_heads=1", "block.backend=reference"],
     r"^model.head_dim=512 does not run on block.attention=fa4, .*"
     r"block.attention=sdpa takes any$"),
    # FA4 takes head dim 80 but computes a wrong gradient there (resolve.FA4_HEAD_DIMS).
    (["model.dim=640", "model.n_heads=8", "model.n_kv_heads=2"],
     r"^model.head_dim=80 does not run on block.attention=fa4, which is "
     r"correct at head dims 32, 64, 96, 128, 160, 192, 224, 256; block.attention=sdpa takes any$"),
    # The cute QK-norm's tiles hold whole heads of its head dims (resolve.QKNORM_HEAD_DIMS).
    (["model.family=qwen3", "model.qk_norm=true", "model.n_heads=8", "model.n_kv_heads=2", "model.dim=768"],
     r"^model.head_dim=96 does not run with model.qk_norm=true on block.backend=cute, whose QK-norm "
     r"epilogue takes head dims 32, 64, 128; use block.backend=reference$"),
])
def test_widths_the_kernels_cannot_take_are_refused_before_anything_compiles(overrides, refusal):
    """A width that is not whole 16-byte rows (or a head dim FA4 lacks) is named, with the nearest
    that run, where the training job and scripts/precompile.py plan their kernels; any vocabulary
    and the reference stages with SDPA take them all."""
    with pytest.raises(ValueError, match=refusal):
        shapes_of([*CODA_KERNELS, *overrides])
    assert shapes_of([*CODA_KERNELS, "model.vocab_size=50257"]).vocab_size == 50257
    sdpa = ["block=coda", "block.backend=reference", "block.attention=sdpa"]
    assert not shapes_of([*sdpa, *overrides[:3]]).any


def test_shapes_of_a_run_config():
    shapes = tiny_shapes()
    assert (shapes.dim, shapes.n_heads, shapes.n_kv_heads, shapes.head_dim) == (128, 4, 2, 32)
    assert (shapes.ffn_dim, shapes.vocab_size, shapes.batch, shapes.seq_len) == (384, 512, 16, 128)
    assert shapes.stages and shapes.fa4
    # Depth never changes the kernels; the micro-batch does (FA4).
    assert shapes_of([*CODA_KERNELS, "model.n_layers=2"]) == shapes
    assert shapes_of([*CODA_KERNELS, "data.seq_len=256"]).key != shapes.key
    # Document masking swaps FA4 for its varlen kernels; the stages stay the same.
    documents = shapes_of([*CODA_KERNELS, *DOCUMENTS])
    assert documents.documents and documents.key == f"{shapes.key} documents"
    # The reference stages with FA4 compile FA4 only.
    fa4_only = shapes_of(["block=coda", "block.backend=reference", "block.attention=fa4", *DOCUMENTS])
    assert not fa4_only.stages and fa4_only.fa4 and fa4_only.documents
    # A QKV bias swaps in the bias variants of F4 and the RoPE backward.
    assert shapes_of([*CODA_KERNELS, *QKV_BIAS]).key == f"{shapes.key} qkv_bias"
    # Qwen3's QK-norm swaps in the QK-norm variants of F4 and the RoPE backward.
    assert shapes_of([*CODA_KERNELS, *QK_NORM]).key == f"{shapes.key} qk_norm"
    cute_sdpa = ["block=coda", "block.backend=cute", "block.attention=sdpa"]
    assert shapes_of([*cute_sdpa, "data.keep_document_boundaries=true"]).key == shapes_of(cute_sdpa).key
    # No CuTeDSL kernel: the eager block, the reference stages with SDPA, `auto` on a CPU.
    assert not shapes_of(["block=eager"]).any
    reference = ["block=coda", "block.backend=reference", "block.attention=sdpa"]
    assert not shapes_of(reference).any
    assert not shapes_of(["block=coda"], torch.device("cpu")).any


@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in CUDA_EXTRAS),
    reason="needs the cuda extras (nvidia-cutlass-dsl, quack-kernels, flash-attn-4) and triton",
)
def test_a_qk_norm_model_lists_the_qk_norm_kernels_in_whole_head_tiles():
    """Qwen3's QK-norm swaps F4 and the RoPE backward for their QK-norm variants in the precompile
    specs, and F4's QK-norm tiles hold whole heads of every head dim resolve lets through."""
    from codatrain.kernels.cute.compile_specs import kernel_specs
    from codatrain.kernels.cute.configs import gemm_config
    from codatrain.kernels.resolve import QKNORM_HEAD_DIMS

    names = [spec.name for spec in kernel_specs(shapes_of([*CODA_KERNELS, *QK_NORM]))]
    assert "F4 QKV · rstd + QK-norm + RoPE" in names and "QK-norm + RoPE backward + ZdZ" in names
    assert "F4 QKV · rstd + RoPE" not in names and "RoPE backward + ZdZ" not in names
    plain = [spec.name for spec in kernel_specs(tiny_shapes())]
    assert "F4 QKV · rstd + RoPE" in plain and "QK-norm + RoPE backward + ZdZ" not in plain
    assert all(gemm_config("rstd_qknorm_rope").tile_n % head_dim == 0 for head_dim in QKNORM_HEAD_DIMS)


def test_the_fp8_recipe_is_part_of_the_kernel_shapes(tmp_path):
    """block.precision=fp8 on the cute stages launches the FP8 forms of the layer GEMM stages and
    quantize passes, and the gradients' format and block.fp8_wgrad change which: each is a cache
    entry of its own, so a cache built for bf16 (or the other FP8 mode) does not pass for an FP8 job,
    which would compile its FP8 kernels in its first step. The reference stages simulate FP8 with
    no kernels of their own (their shapes stay FA4's), and the amax history and margin change none."""
    bf16 = tiny_shapes()
    fp8 = shapes_of([*CODA_KERNELS, *FP8])
    assert fp8.fp8 and not bf16.fp8
    assert fp8.key == f"{bf16.key} fp8 grads_e5m2 fp8_wgrad"  # FP8 weight gradients: the default
    wgrad = shapes_of([*CODA_KERNELS, *FP8, "block.fp8_wgrad=false"])
    assert wgrad.key == f"{bf16.key} fp8 grads_e5m2"
    e4m3 = shapes_of([*CODA_KERNELS, *FP8, "block.fp8_grad_format=e4m3"])
    assert e4m3.key == f"{bf16.key} fp8 grads_e4m3 fp8_wgrad"
    assert shapes_of([*CODA_KERNELS, *FP8, "block.fp8_history_len=4", "block.fp8_margin=1"]) == fp8
    reference = ["block=coda", "block.backend=reference", "block.attention=fa4"]
    assert shapes_of([*reference, *FP8]) == shapes_of(reference)

    write_manifest(tmp_path, bf16)
    for shapes in (fp8, wgrad, e4m3):
        (problem,) = cache_problems(tmp_path, shapes)
        assert "not built for this config" in problem and shapes.key in problem


def test_cache_problems_name_every_difference(tmp_path):
    shapes = tiny_shapes()
    (problem,) = cache_problems(tmp_path, shapes)
    assert "never built" in problem

    write_manifest(tmp_path, shapes)
    assert cache_problems(tmp_path, shapes) == []
    other = shapes_of([*CODA_KERNELS, "train.micro_batch_size=8"])
    (problem,) = cache_problems(tmp_path, other)
    assert "not built for this config" in problem and shapes.key in problem
    (problem,) = cache_problems(tmp_path, shapes, num_sms=114)
    assert problem.startswith("sms:")

    write_manifest(tmp_path, shapes, **{"quack-kernels": "0.0.1", "codatrain kernel sources": "0" * 64})
    problems = cache_problems(tmp_path, shapes)
    assert [p.split(":")[0] for p in problems] == ["quack-kernels", "codatrain kernel sources"]
    assert "'0.0.1'" in problems[0]


def test_stale_cache_fails_with_the_differences(tmp_path):
    shapes = tiny_shapes()
    write_manifest(tmp_path, shapes, python="2.7")
    with pytest.raises(KernelCacheError, match=r"kernels.on_stale=fail(.|\n)*python: built for '2.7'"):
        ensure_cache(tmp_path, shapes, on_stale="fail")

    write_manifest(tmp_path, shapes)
    messages = []
    ensure_cache(tmp_path, shapes, on_stale="fail", log=messages.append)
    assert "holds the kernels of this run" in messages[0]
    assert read_manifest(tmp_path)["configs"] == {shapes.key: {}}


def test_on_stale_is_validated():
    with pytest.raises(ConfigCompositionException, match="kernels.on_stale"):
        run_config(["kernels.on_stale=sometimes"])


def test_cpu_training_ignores_the_cache_and_reports_its_startup(tmp_path):
    cache = KernelCache(tmp_path, DistInfo(0, 0, 1, torch.device("cpu")))
    cache.ensure(tiny_shapes(), on_stale="fail")
    assert cache.cache_dir is None and not list(tmp_path.iterdir())
    assert cache.first_step_report().startswith("time to first step: ")
    assert 0 < process_age_s() < 1e6


def test_script_check_and_nothing_to_compile(tmp_path):
    proc = precompile_script("block=eager", f"kernels.cache_dir={tmp_path}")
    assert proc.returncode == 0 and "nothing to compile" in proc.stdout
    proc = precompile_script("--check", f"kernels.cache_dir={tmp_path}")
    assert proc.returncode == 1 and "stale:" in proc.stdout and "never built" in proc.stdout
    proc = precompile_script("model=tiny")
    assert proc.returncode == 1 and "kernels.cache_dir" in proc.stderr


def test_no_compile_process_is_refused_before_a_manifest_is_written(tmp_path):
    # --jobs -1 started no compile process and recorded the config as built with no kernels, so
    # --check said "fits"; then a traceback (max() of no kernel names).
    proc = precompile_script("--jobs", "-1", f"kernels.cache_dir={tmp_path / 'script'}")
    assert proc.returncode == 2 and "argument --jobs: must be 1 or more, got -1" in proc.stderr
    proc = precompile_script("--sms", "0", f"kernels.cache_dir={tmp_path / 'script'}")
    assert proc.returncode == 2 and "argument --sms: must be 1 or more, got 0" in proc.stderr
    assert not (tmp_path / "script").exists()
    with pytest.raises(ValueError, match="jobs must be positive"):
        precompile(tiny_shapes(), tmp_path / "library", jobs=-2)
    assert read_manifest(tmp_path / "library") is None


@pytest.mark.slow
@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in CUDA_EXTRAS),
    reason="needs the cuda extras (nvidia-cutlass-dsl, quack-kernels, flash-attn-4) and triton",
)
# One build covers Qwen3's QK-norm, another the odd widths, the QKV bias and the documents (each
# build costs CI a minute or two).
@pytest.mark.parametrize("widths, fa4_kernels",
                         [(QK_NORM, FA4_FIXED), ([*ODD_SHAPES, *QKV_BIAS, *DOCUMENTS], FA4_VARLEN)],
                         ids=["tiny-qk-norm", "odd-shapes-qkv-bias-documents"])
def test_precompile_tiny_for_sm90a(tmp_path, widths, fa4_kernels):
    """The tiny config as a Qwen3 (its QK-norm: the QK-norm variants of F4 and of the RoPE
    backward), and the tiny config with a vocabulary that is not a multiple of 8 (its LM head pads
    the logits rows; unpadded, the cross-entropy kernel stopped the build with a compiler error), an
    out-projection and down-projection that tile differently (F1 and F3 leave different numbers of
    x² partials), a QKV bias (Qwen2: the bias variants of F4 and the RoPE backward) and
    data.keep_document_boundaries (FA4's varlen forward and backward, both with up to and over 256
    documents per micro-batch, FA4's two variants, instead of its fixed-length kernels; the stages
    do not change with documents). A micro-step of the model on fake tensors then finds every
    stage kernel it launches in the cache (tests/fake_job.py): a precompiled job compiles nothing."""
    proc = precompile_script("model=tiny", *widths, f"kernels.cache_dir={tmp_path}", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    shapes = shapes_of([*CODA_KERNELS, *widths])
    counts = fake_job(tmp_path, shapes)
    assert counts["compiled"] == 0 and counts["loaded"] >= 10, counts
    entry = read_manifest(tmp_path)["configs"][shapes.key]
    kernels = set(entry["kernels"])
    stages = ("F1 out-proj", "F2 gate/up", "F4 QKV", "LM head linear cross-entropy", "final RMSNorm backward")
    if widths == QK_NORM:
        stages += ("F4 QKV · rstd + QK-norm + RoPE", "QK-norm + RoPE backward")
    for stage in stages:
        assert any(name.startswith(stage) for name in kernels), f"{stage} missing from {sorted(kernels)}"
    assert [name for name in entry["kernels"] if name.startswith("FA4")] == fa4_kernels
    # Each FA4 spec compiled a main kernel of its own (FA4 files its objects by kernel kind).
    kinds = [path.parent.name for path in (tmp_path / "fa4").rglob("*.o")]
    assert kinds.count("fwd") == kinds.count("bwd") == len(fa4_kernels) // 2
    # 22 objects today; at least one per kernel family.
    assert len(list((tmp_path / "quack").rglob("*.o"))) >= 15
    assert cache_problems(tmp_path, shapes) == []
    check = precompile_script("--check", "model=tiny", *widths, f"kernels.cache_dir={tmp_path}")
    assert check.returncode == 0 and "fits" in check.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in CUDA_EXTRAS),
    reason="needs the cuda extras (nvidia-cutlass-dsl, quack-kernels, flash-attn-4) and triton",
)
def test_precompile_fp8_for_sm90a(tmp_path):
    """block.precision=fp8, with the weight gradients in bf16, then in FP8, then in FP8 with every
    stage on fast accumulation, then Qwen2's and Qwen3's models (built into the same cache: a later
    build compiles only what it adds). A job's two kinds of micro-step on fake tensors, a run's
    first (current scaling: F1/F3 write h in bf16 and a quantize pass follows) and a later one
    (delayed scaling: F1/F3 write h in FP8), then find every kernel they launch in the cache
    (tests/fake_job.py): the FP8 layer GEMMs, forward and backward, and every quantize pass with
    its format and width, row-major or into both orientations."""
    # The second build loads all but a few kernels: one compile process is the quicker there.
    builds = ((["block.fp8_wgrad=false"], 8, "2"), (["block.fp8_wgrad=true"], 8, "1"),
              (["block.fp8_wgrad=true", "block.fp8_fast_accum=true"], 8, "2"))
    for extra, quantize_passes, jobs in builds:
        overrides = [*FP8_STAGES, *extra]
        proc = precompile_script("model=tiny", *overrides, f"kernels.cache_dir={tmp_path}", "--jobs", jobs)
        assert proc.returncode == 0, proc.stderr[-5000:]
        shapes = shapes_of(overrides)
        counts = fake_job(tmp_path, shapes)
        assert counts["compiled"] == 0 and counts["loaded"] >= 15, counts
        kernels = read_manifest(tmp_path)["configs"][shapes.key]["kernels"]
        stages = ("F1 out-proj on FP8", "F2 gate/up on FP8", "F3 down-proj on FP8", "F4 QKV on FP8",
                  "dSwiGLU in the down-proj dgrad, FP8", "norm backward + residual gradient of the gate/up "
                  "and QKV dgrads, FP8", "LM head linear cross-entropy")
        for stage in stages:
            assert any(name.startswith(stage) for name in kernels), f"{stage} missing from {kernels}"
        assert len([name for name in kernels if name.startswith("quantize")]) == quantize_passes, kernels
        assert not any(name.startswith(("F2 gate/up · rstd", "FA4")) for name in kernels), kernels
        assert cache_problems(tmp_path, shapes) == []
    # Qwen2's QKV bias and Qwen3's QK-norm on FP8 operands (F4's FP8 variants and their RoPE
    # backwards), built from their kernel shapes: the run plan refuses them on the cute stages until
    # their GPU tests have run.
    fp8_wgrad = shapes_of([*FP8_STAGES, "block.fp8_wgrad=true"])
    for family, stage in (({"qkv_bias": True}, "F4 QKV on FP8 operands · rstd + RoPE"),
                          ({"qk_norm": True}, "F4 QKV on FP8 operands · rstd + QK-norm + RoPE")):
        shapes = dataclasses.replace(fp8_wgrad, **family)
        precompile(shapes, tmp_path, jobs=1, log=lambda line: None)
        counts = fake_job(tmp_path, shapes)
        assert counts["compiled"] == 0 and counts["loaded"] >= 15, counts
        assert stage in read_manifest(tmp_path)["configs"][shapes.key]["kernels"]
        assert cache_problems(tmp_path, shapes) == []


@pytest.mark.slow
@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in CUDA_EXTRAS),
    reason="needs the cuda extras (nvidia-cutlass-dsl, quack-kernels, flash-attn-4) and triton",
)
def test_every_gemm_keeps_four_k_tiles_in_flight(tmp_path):
    """QuACK gives a GEMM's A/B pipeline the shared memory its epilogue leaves. The FP8 norm
    backward and dSwiGLU in 128×128 cooperative tiles were left 3 k-tiles (their C, TileLoad and
    outputs staged four deep): a latency-bound mainloop at 1.8–2.1× `_scaled_mm`, 1.2–1.7× in the
    128×112 tiles that leave 4–5 (docs/benchmarks.md, "FP8 backward tiles"). Every GEMM the tiny
    config's FP8 job builds (the FP8 layer stages, the bf16 LM head's) keeps at least 4
    (`scripts/kernel_report.py`, which also counts each kernel's register spills in its SASS; the
    bf16 layer stages keep 4–6, `python scripts/kernel_report.py model=tiny`, not run here to keep
    CI short)."""
    overrides = ["model=tiny", *FP8_STAGES, "block.fp8_wgrad=true"]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_report.py"), *overrides,
                           "--json", str(tmp_path / "report.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    kernels = json.loads((tmp_path / "report.json").read_text())["kernels"]
    names = {k["kernel"] for k in kernels}
    for name in ("fp8_rms_bwd", "fp8_dswiglu", "fp8_residual_rms", "rstd_lse"):
        assert any(name in kernel for kernel in names), f"no {name} kernel among {sorted(names)}"
    # Every kernel's SASS was found (its spills counted) and its pipeline is deep enough.
    assert all(k["spill_stores"] is not None for k in kernels), kernels
    shallow = [k for k in kernels if k["ab_stages"] < 4]
    assert not shallow, shallow
