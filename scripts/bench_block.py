"""Time one CODA block, forward and backward, against its GEMM floor, eager PyTorch and torch.compile.

The headline (section `fwd_bwd`) is one middle layer, forward + backward, timed interleaved in one
process for four implementations:
- eager: `codatrain.model.llama.Block` in bf16 (SDPA attention);
- compile: the same block under torch.compile;
- CODA: `codatrain.model.coda.CodaLayer` on the chosen backend (`--impl`), FA4 attention on cute;
- floor: the same twelve GEMMs in cuBLAS (torch.mm: four forward, four dgrad, four wgrad) plus
  the attention forward + backward: what a design whose non-GEMM work hides in epilogues
  approaches.
Targets at Llama-3-8B shapes: CODA ≤ 1.05 × floor and compile / CODA ≥ 1.15.

Per stage (sections `stages` and `layer`) it reports, at the widths of a model preset and M tokens:
- the stage's own time;
- the same GEMM alone (cuBLAS through torch.mm, bf16 output), the floor a fused epilogue aims at;
- the eager PyTorch ops the stage replaces (the reference backend's stage, which is the GEMM
  followed by the elementwise/reduction ops as separate kernels);
and the ratios stage / GEMM (target ≤ 1.05 at Llama-3-8B shapes) and eager / stage. Rows for
attention (FA4 when the backend is cute, else SDPA) and for one whole layer forward (F4,
attention, F1 R1 F2 F3 R2) against its floor (the four GEMMs alone plus attention) and the eager
Llama block complete the table. Times are medians of many runs, all measured in one process.

    python scripts/bench_block.py --impl cute --compile           # Llama-3-8B widths, M = 8192
    python scripts/bench_block.py --impl cute --compile --sections fwd_bwd
    python scripts/bench_block.py --impl cute --sweep F1 F3       # + time candidate GEMM configs
    python scripts/bench_block.py --impl reference --model tiny --tokens 512 --device cpu
    python scripts/bench_block.py --model llama3_1b --tokens 32768 --sections head --compile \
        --head-chunks 2048 4096 8192                                # the training LM head alone
    python scripts/bench_block.py --tokens 16384 --sections fp8 quantize  # FP8 stages, quantize passes
    python scripts/bench_block.py --model qwen3_8b --tokens 16384 --sections qknorm  # Qwen3's QK-norm
    python scripts/bench_block.py --tokens 16384 --sections layouts  # plain dgrad/wgrad layouts

Section `qknorm` times F4 with Qwen3's QK-norm (`gemm_rstd_qknorm_rope`) against F4 without it and
the QKV GEMM alone (the issue's target: ≤ 1.05 × the plain QKV stage), and its backward against the
RoPE backward; both against the reference stages (eager PyTorch). On the cute backend it also times
the QK-norm GEMM kernel called without the backend around it (operands prepared once), and prints
each call's host time beside its GPU time: a call whose host time passes its GPU time makes the
GPU wait, in a training step as here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from codatrain.kernels.attention import get_attention
from codatrain.kernels.fp8 import Fp8Tensor, QuantizeTo
from codatrain.kernels.resolve import resolve_block
from codatrain.kernels.stages import IGNORE_INDEX, BackendUnavailableError, StageBackend, get_backend
from codatrain.model.coda import CodaLayer, ForwardStep
from codatrain.model.config import LlamaConfig, get_preset
from codatrain.model.llama import Block, rope_cos_sin

EPS = 1e-5


SPIN_CYCLES = 1_000_000  # about 0.5 ms at an H100's or H200's ~2 GHz SM clock


def median_ms(fns: list[Callable[[], object]], device: torch.device, *, warmup: int, iters: int) -> list:
    """Median time of each fn over `iters` calls, after `warmup` untimed ones (compiles, caches).

    The fns are timed interleaved (one call of each per round), so a drift of the GPU clock
    shifts all of them alike and their ratios hold. On a GPU each call is preceded by a 256 MB
    memset, as in triton's do_bench: it evicts the operands from L2 (each call reads its weights
    from HBM, as in training). Then a 0.5 ms spin keeps the GPU busy while the host enqueues the
    call (the memset alone lasts 0.08 ms, shorter than some stages' host paths), so the time is
    the GPU's, as in a training step whose host runs ahead, without the launch overhead; `host_ms`
    times the host's part."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if device.type == "cuda" else None
    for _ in range(iters):
        for fn, fn_times in zip(fns, times, strict=True):
            if flush is None:
                start = time.perf_counter()
                fn()
                fn_times.append((time.perf_counter() - start) * 1e3)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            torch.cuda._sleep(SPIN_CYCLES)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            fn_times.append(begin.elapsed_time(end))
    return [statistics.median(t) for t in times]


class Inputs:
    """Random bf16 operands at the widths of `cfg` with M = `tokens` rows (weights scaled so that
    GEMM outputs are O(1), as in a trained model)."""

    def __init__(
        self, cfg: LlamaConfig, tokens: int, seq_len: int, device: torch.device, dtype: torch.dtype,
        head_chunk_rows: int,
    ):
        self.cfg, self.m, self.seq_len, self.batch = cfg, tokens, seq_len, tokens // seq_len
        d, f, attn = cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.head_dim

        def randn(*shape: int, fan_in: int = 1) -> torch.Tensor:
            return (torch.randn(*shape, device=device) * fan_in**-0.5).to(dtype)

        self.x = randn(tokens, d)
        self.h = randn(tokens, d)
        self.attn_out = randn(tokens, attn)
        self.y = randn(tokens, f)
        self.rstd = torch.rand(tokens, device=device) + 0.5
        self.gamma = (torch.rand(d, device=device) + 0.5).to(dtype)
        self.w_o = randn(d, attn, fan_in=attn)
        self.w_gu = randn(2 * f, d, fan_in=d)
        self.w_down = randn(d, f, fan_in=f)
        self.w_qkv = randn(cfg.qkv_dim, d, fan_in=d)
        self.w_head = randn(cfg.vocab_size, d, fan_in=d)
        self.embedding = randn(cfg.vocab_size, d)
        self.tokens = torch.randint(0, cfg.vocab_size, (tokens,), device=device)
        self.positions = torch.arange(tokens, device=device) % seq_len
        self.sq_partials = torch.rand(tokens, -(-d // 128), device=device)
        self.rope = {"head_dim": cfg.head_dim, "rope_heads": cfg.n_heads + cfg.n_kv_heads, "rope": cfg.rope}
        # Backward operands: gradients arriving at the stages, and the forward tensors they read.
        self.qkv = randn(tokens, cfg.qkv_dim)
        self.dqkv = randn(tokens, cfg.qkv_dim)
        self.preact = randn(tokens, 2 * f)
        self.zdz = torch.randn(tokens, device=device)
        self.head_chunk_rows = head_chunk_rows  # as the CODA model cuts the LM head


Row = tuple[str, Callable, Callable | None, Callable]  # name, timed call, GEMM floor, eager call


def stage_rows(s: StageBackend, ref: StageBackend, x: Inputs) -> list[Row]:
    """(name, stage call, the same GEMM alone or None, the reference stage call) per stage."""
    c = x.cfg

    def both(method: str, *args, **kwargs) -> tuple[Callable, Callable]:
        return (lambda: getattr(s, method)(*args, **kwargs)), (lambda: getattr(ref, method)(*args, **kwargs))

    def gemm(a: torch.Tensor, w: torch.Tensor) -> Callable:
        return lambda: torch.mm(a, w.t())

    def dgrad(dz: torch.Tensor, w: torch.Tensor) -> Callable:
        return lambda: torch.mm(dz, w)

    def wgrad(dz: torch.Tensor, a: torch.Tensor) -> Callable:
        return lambda: torch.mm(dz.t(), a)

    rows = []
    for name, method, args, kwargs, floor in [
        ("entry", "entry", (x.tokens, x.embedding, x.gamma), {"eps": EPS}, None),
        ("F1 out-proj +res +x² +γ", "gemm_residual_rms", (x.attn_out, x.w_o, x.x, x.gamma), {},
         gemm(x.attn_out, x.w_o)),
        ("R rstd", "rstd_from_partials", (x.sq_partials,), {"dim": c.dim, "eps": EPS}, None),
        ("F2 gate/up ·r +SwiGLU", "gemm_rstd_swiglu", (x.h, x.w_gu, x.rstd), {}, gemm(x.h, x.w_gu)),
        ("F3 down +res +x² +γ", "gemm_residual_rms", (x.y, x.w_down, x.x, x.gamma), {}, gemm(x.y, x.w_down)),
        ("F4 QKV ·r +RoPE", "gemm_rstd_rope", (x.h, x.w_qkv, x.rstd, x.positions), x.rope,
         gemm(x.h, x.w_qkv)),
        ("LM head ·r +LSE +target", "gemm_rstd_lse", (x.h, x.w_head, x.rstd, x.tokens), {},
         gemm(x.h, x.w_head)),
        ("LM head ·r (logits)", "gemm_rstd", (x.h, x.w_head, x.rstd), {}, gemm(x.h, x.w_head)),
        ("B RoPE bwd + ZdZ", "rope_bwd", (x.dqkv, x.qkv, x.positions), x.rope, None),
        ("B QKV dgrad + RMSNorm bwd + residual", "gemm_rms_bwd",
         (x.dqkv, x.w_qkv, x.x, x.gamma, x.rstd, x.zdz, x.x), {}, dgrad(x.dqkv, x.w_qkv)),
        ("B down dgrad + dSwiGLU + ZdZ", "gemm_dswiglu", (x.x, x.w_down, x.preact), {},
         dgrad(x.x, x.w_down)),
        ("B gate/up dgrad + RMSNorm bwd + residual", "gemm_rms_bwd",
         (x.preact, x.w_gu, x.x, x.gamma, x.rstd, x.zdz, x.x), {}, dgrad(x.preact, x.w_gu)),
        ("B out-proj dgrad", "dgrad", (x.x, x.w_o), {}, dgrad(x.x, x.w_o)),
        ("B out-proj wgrad", "wgrad", (x.x, x.attn_out), {}, wgrad(x.x, x.attn_out)),
        ("B gate/up wgrad", "wgrad", (x.preact, x.h), {}, wgrad(x.preact, x.h)),
        ("B down wgrad", "wgrad", (x.x, x.y), {}, wgrad(x.x, x.y)),
        ("B QKV wgrad", "wgrad", (x.dqkv, x.h), {}, wgrad(x.dqkv, x.h)),
        ("B embedding bwd", "entry_bwd", (x.x, x.tokens), {"num_embeddings": c.vocab_size}, None),
    ]:
        stage, eager = both(method, *args, **kwargs)
        rows.append((name, stage, floor, eager))
    return rows


def host_ms(fn: Callable[[], object], device: torch.device, iters: int = 20) -> float:
    """The host's time per call of `fn`, calls enqueued back to back (the GPU runs behind)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    ms = (time.perf_counter() - start) / iters * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ms


def qknorm_kernel_alone(x: Inputs, weights: dict[str, torch.Tensor], fwd: object) -> Callable[[], None]:
    """The cute QK-norm GEMM's custom op on operands and outputs prepared once: without the
    backend's per-call checks and output allocations."""
    from codatrain.kernels.cute import gemm_stages

    c, rope_heads = x.cfg, x.rope["rope_heads"]
    args = (x.h, x.w_qkv, x.rstd, x.positions, None, weights["q_weight"], weights["k_weight"],
            torch.empty_like(fwd.qkv), torch.empty_like(fwd.z), c.head_dim, c.n_heads, rope_heads, EPS,
            *gemm_stages.rope_args(x.rope["rope"]))
    return lambda: gemm_stages.gemm_rstd_qknorm_rope(*args)


def qknorm_fns(s: StageBackend, ref: StageBackend, x: Inputs) -> dict[str, dict[str, Callable]]:
    """The QK-norm stages and what they compare with, forward and backward, at `x`'s widths."""
    c, device = x.cfg, x.h.device
    weights = {key: (torch.rand(c.head_dim, device=device) + 0.5).to(x.h.dtype)
               for key in ("q_weight", "k_weight")}
    norm = {"q_heads": c.n_heads, "eps": EPS, **weights}
    fwd_args = (x.h, x.w_qkv, x.rstd, x.positions)
    # Each backward reads its own forward's z (the backends save it in different layouts).
    fwd, ref_fwd = (b.gemm_rstd_qknorm_rope(*fwd_args, **x.rope, **norm) for b in (s, ref))
    bwd_args, ref_bwd_args = ((x.dqkv, out.qkv, out.z, x.positions) for out in (fwd, ref_fwd))
    cute = s.name == "cute"
    kernel_alone = {"F4 QK-norm kernel alone": qknorm_kernel_alone(x, weights, fwd)} if cute else {}
    return {
        "forward": {
            "QKV GEMM (cuBLAS)": lambda: torch.mm(x.h, x.w_qkv.t()),
            "F4 ·r +RoPE": lambda: s.gemm_rstd_rope(*fwd_args, **x.rope),
            "F4 ·r +QK-norm +RoPE": lambda: s.gemm_rstd_qknorm_rope(*fwd_args, **x.rope, **norm),
            **kernel_alone,
            "reference F4 +QK-norm": lambda: ref.gemm_rstd_qknorm_rope(*fwd_args, **x.rope, **norm),
        },
        "backward": {
            "RoPE bwd + ZdZ": lambda: s.rope_bwd(x.dqkv, x.qkv, x.positions, **x.rope),
            "QK-norm + RoPE bwd + ZdZ": lambda: s.qknorm_rope_bwd(*bwd_args, **x.rope, **norm),
            "reference QK-norm + RoPE bwd": lambda: ref.qknorm_rope_bwd(*ref_bwd_args, **x.rope, **norm),
        },
    }


def layer_rows(
    s: StageBackend, x: Inputs, device: torch.device, attention_name: str, compile_eager: bool
) -> list[Row]:
    """Attention alone, and one layer forward: CODA stages vs its GEMM+attention floor vs eager."""
    c, b, t = x.cfg, x.batch, x.seq_len
    attention = get_attention(attention_name, device)
    qkv = torch.randn(b, t, c.n_heads + 2 * c.n_kv_heads, c.head_dim, device=device).to(x.x.dtype)
    sdpa = get_attention("sdpa", device)

    def coda_layer() -> torch.Tensor:
        z = s.gemm_rstd_rope(x.h, x.w_qkv, x.rstd, x.positions, **x.rope)
        o = attention(z.view(b, t, -1, c.head_dim), c.n_kv_heads).reshape(x.m, -1)
        x1, h1, p1 = s.gemm_residual_rms(o, x.w_o, x.x, x.gamma)
        _, y = s.gemm_rstd_swiglu(h1, x.w_gu, s.rstd_from_partials(p1, dim=c.dim, eps=EPS))
        x2, h2, p2 = s.gemm_residual_rms(y, x.w_down, x1, x.gamma)
        return s.rstd_from_partials(p2, dim=c.dim, eps=EPS)

    def floor_layer() -> None:
        torch.mm(x.h, x.w_qkv.t())
        attention(qkv, c.n_kv_heads)
        torch.mm(x.attn_out, x.w_o.t())
        torch.mm(x.h, x.w_gu.t())
        torch.mm(x.y, x.w_down.t())

    with torch.device(device):
        block = Block(c).to(x.x.dtype)
    cos, sin = rope_cos_sin(torch.arange(t, device=device), c.head_dim, c.rope, x.x.dtype)
    x_btd = x.x.view(b, t, c.dim)

    def eager_layer() -> torch.Tensor:
        return block(x_btd, cos, sin)

    qkv_grad = qkv.detach().requires_grad_()
    dout = torch.randn(b, t, c.n_heads, c.head_dim, device=device).to(x.x.dtype)

    def fwd_bwd(fn: Callable) -> Callable:
        def run() -> None:
            qkv_grad.grad = None
            fn(qkv_grad, c.n_kv_heads).backward(dout)

        return run

    rows = [
        (f"attention fwd ({attention_name} vs sdpa)", lambda: attention(qkv, c.n_kv_heads), None,
         lambda: sdpa(qkv, c.n_kv_heads)),
        (f"attention fwd+bwd ({attention_name} vs sdpa)", fwd_bwd(attention), None, fwd_bwd(sdpa)),
        ("layer fwd (CODA vs floor vs eager)", coda_layer, floor_layer, eager_layer),
    ]
    if compile_eager:
        compiled = torch.compile(eager_layer)
        rows.append(("layer fwd (CODA vs floor vs compiled eager)", coda_layer, floor_layer, compiled))
    return rows


def fwd_bwd_fns(
    s: StageBackend, x: Inputs, device: torch.device, attention_name: str, compile_eager: bool
) -> dict[str, Callable]:
    """One middle layer forward + backward: eager, compile (optional), CODA and the floor.

    Every call clears the parameter gradients first, so no call pays for accumulating into the
    previous call's gradients."""
    c, b, t, m = x.cfg, x.batch, x.seq_len, x.m
    dtype = x.x.dtype
    attention = get_attention(attention_name, device)

    def randn(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * fan_in**-0.5).to(dtype)

    with torch.device(device):
        layer = CodaLayer(c, 0).to(dtype)  # a middle layer; its index only names FP8 amax histories
        block = Block(c).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else randn(*p.shape, fan_in=p.shape[1]))
    step = ForwardStep.of(s, attention, b, t, device)
    qkv_in = x.qkv.detach().clone().requires_grad_()
    x_in = x.x.detach().clone().requires_grad_()
    dx_out, dqkv_out = randn(m, c.dim), randn(m, c.qkv_dim)

    def coda() -> None:
        layer.zero_grad(set_to_none=True)
        qkv_in.grad = x_in.grad = None
        torch.autograd.backward(layer(qkv_in, x_in, step), (dx_out, dqkv_out))

    cos, sin = rope_cos_sin(torch.arange(t, device=device), c.head_dim, c.rope, dtype)
    x_btd = x.x.view(b, t, c.dim).detach().clone().requires_grad_()
    dout = dx_out.view(b, t, c.dim)

    def run_block(module: Callable) -> Callable:
        def run() -> None:
            block.zero_grad(set_to_none=True)
            x_btd.grad = None
            module(x_btd, cos, sin).backward(dout)

        return run

    # The floor: the layer's GEMMs alone (forward, dgrad and wgrad of each weight) and attention.
    qkv_heads = x.qkv.view(b, t, -1, c.head_dim).detach().requires_grad_()
    dattn = randn(b, t, c.n_heads, c.head_dim)
    d_o, d_pre = randn(m, c.dim), randn(m, 2 * c.ffn_dim)

    def floor() -> None:
        torch.mm(x.h, x.w_qkv.t())
        attention(qkv_heads, c.n_kv_heads).backward(dattn)
        qkv_heads.grad = None
        torch.mm(x.attn_out, x.w_o.t())
        torch.mm(x.h, x.w_gu.t())
        torch.mm(x.y, x.w_down.t())
        for dz, w, a in ((d_o, x.w_down, x.y), (d_pre, x.w_gu, x.h), (d_o, x.w_o, x.attn_out),
                         (x.dqkv, x.w_qkv, x.h)):
            torch.mm(dz, w)
            torch.mm(dz.t(), a)

    fns = {"eager": run_block(block), "CODA": coda, "floor": floor}
    if compile_eager:
        fns["compile"] = run_block(torch.compile(block))
    return fns


def head_fns(s: StageBackend, x: Inputs, device: torch.device, chunks: list[int],
             compile_eager: bool) -> dict[str, Callable]:
    """The training head alone, forward + backward over M = --tokens rows: the final RMSNorm, the
    LM head and the summed cross-entropy, with the gradients of x, γ and W.

    - floor: its three GEMMs in cuBLAS (logits n·Wᵀ, dgrad dlogits·W, wgrad dlogitsᵀ·n), bf16;
    - eager: the eager Llama's final norm, head and `lm_loss` (M×V logits and their fp32 copy);
      compile: the same under torch.compile;
    - liger: the eager norm, then liger-kernel's fused linear cross-entropy (when installed);
    - quack LCE <pipeline> c<N>: QuACK's `chunked_linear_cross_entropy` on n itself (no norm),
      untuned (its autotuner would compile dozens of GEMM configs first), as the CODA head calls it;
    - CODA c<N>: the backend's `lm_head_ce` in N-row chunks and the backward's scaling of its
      gradients (the model's `_FinalLossFn`, without the last layer's MLP);
    - CODA LCE part c<N> (cute backend): the same without the final norm's forward and backward
      (the cute head's cross-entropy pipelines on n, then the scaling), to place its cost over
      QuACK's LCE in the norm or in the cross-entropy part."""
    from codatrain.model.llama import RMSNorm, lm_loss

    c, m = x.cfg, x.m
    norm = RMSNorm(c.dim, EPS).to(device=device, dtype=x.x.dtype)
    with torch.no_grad():
        norm.weight.copy_(x.gamma)
    x_in = x.x.detach().clone().requires_grad_()
    w = x.w_head.detach().clone().requires_grad_()
    n = norm(x.x).detach().requires_grad_()
    targets = x.tokens
    logits_out, dlogits = torch.empty(m, c.vocab_size, device=device, dtype=x.x.dtype), \
        torch.randn(m, c.vocab_size, device=device).to(x.x.dtype)
    leaves = (x_in, w, n, norm.weight)

    def clear() -> None:
        for leaf in leaves:
            leaf.grad = None

    def floor() -> None:
        torch.mm(x.h, x.w_head.t(), out=logits_out)
        torch.mm(dlogits, x.w_head)
        torch.mm(dlogits.t(), x.h)

    def eager_head(x_rows: torch.Tensor) -> torch.Tensor:
        logits = norm(x_rows) @ w.t()
        return lm_loss(logits[None], targets[None], reduction="sum")

    def run(loss_fn: Callable[[], torch.Tensor]) -> Callable:
        def call() -> None:
            clear()
            loss_fn().backward()

        return call

    fns = {"floor (3 cuBLAS GEMMs)": floor, "eager": run(lambda: eager_head(x_in))}
    if compile_eager:
        compiled = torch.compile(eager_head)
        fns["compile"] = run(lambda: compiled(x_in))
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        fns["liger FLCE"] = run(lambda: liger(w, norm(x_in), targets))
    except ImportError as exc:
        print(f"head: no liger row ({exc})")
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    scale = torch.ones((), device=device)

    def coda(chunk: int) -> Callable:
        def call() -> None:
            out = s.lm_head_ce(x.x, x.gamma, x.w_head, targets, eps=EPS, chunk_rows=chunk)
            out.dx * scale, out.dgamma * scale
            s.lm_head_dweight(*out[3:], scale, x.x.dtype)

        return call

    def coda_lce_part(chunk: int) -> Callable:
        from codatrain.kernels.cute import head

        def call() -> None:
            _, _, *parts = head.linear_cross_entropy(n.detach(), x.w_head, targets, chunk, IGNORE_INDEX)
            dweight = head.split_dweight(parts, m, c.dim, c.vocab_size, chunk)
            head.lm_head_dweight(*dweight, scale, x.x.dtype)

        return call

    for chunk in chunks:
        for pipeline, scaled_exp in (("scaled-exp", True), ("base", False)):
            fns[f"quack LCE {pipeline} c{chunk}"] = run(
                lambda chunk=chunk, scaled_exp=scaled_exp: chunked_linear_cross_entropy(
                    n, w, targets, chunk_size=chunk, reduction="sum", tuned=False, use_scaled_exp=scaled_exp
                )
            )
        fns[f"CODA c{chunk}"] = coda(chunk)
        if s.name == "cute":
            fns[f"CODA LCE part c{chunk}"] = coda_lce_part(chunk)
    return fns


def peak_gib(fn: Callable, device: torch.device) -> float:
    """GiB a call allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


LAYER_STAGES = ["F1", "F2", "F3", "F4", "Bdswiglu", "Brms_gu", "Brms_qkv"]


def stage_gemms(s: StageBackend, x: Inputs) -> dict[str, tuple]:
    """Per cute GEMM stage: its key in configs.py, the stage call, and the operands A, B of its GEMM
    (A @ B is the same GEMM in cuBLAS) with C, the M × N tensor its epilogue reads besides the
    accumulator (the residual, or the residual's gradient), or None."""
    from codatrain.kernels.cute.gemm_stages import residual_rms_stage

    norm_bwd = (x.x, x.gamma, x.rstd, x.zdz, x.x)  # the norm's input, γ, rstd, zdz, residual grad
    qk_norm = {}
    if x.cfg.qk_norm:  # Qwen3: F4 with the QK-norm (its config key differs from F4's)
        head_weight = (torch.rand(x.cfg.head_dim, device=x.h.device) + 0.5).to(x.h.dtype)
        norm = {"q_heads": x.cfg.n_heads, "q_weight": head_weight, "k_weight": head_weight, "eps": EPS}
        f4_args = (x.h, x.w_qkv, x.rstd, x.positions)
        qk_norm["F4qk"] = ("rstd_qknorm_rope", lambda: s.gemm_rstd_qknorm_rope(*f4_args, **x.rope, **norm),
                           x.h, x.w_qkv.t(), None)
    return {
        "F1": (residual_rms_stage(*x.w_o.shape[::-1]),
               lambda: s.gemm_residual_rms(x.attn_out, x.w_o, x.x, x.gamma), x.attn_out, x.w_o.t(), x.x),
        "F3": (residual_rms_stage(*x.w_down.shape[::-1]),
               lambda: s.gemm_residual_rms(x.y, x.w_down, x.x, x.gamma), x.y, x.w_down.t(), x.x),
        "F2": ("rstd_swiglu", lambda: s.gemm_rstd_swiglu(x.h, x.w_gu, x.rstd), x.h, x.w_gu.t(), None),
        "F4": ("rstd_rope", lambda: s.gemm_rstd_rope(x.h, x.w_qkv, x.rstd, x.positions, **x.rope),
               x.h, x.w_qkv.t(), None),
        "LM": ("rstd_lse", lambda: s.gemm_rstd_lse(x.h, x.w_head, x.rstd, x.tokens), x.h, x.w_head.t(), None),
        "Bdswiglu": ("dswiglu", lambda: s.gemm_dswiglu(x.x, x.w_down, x.preact), x.x, x.w_down, None),
        "Brms_gu": ("rms_bwd", lambda: s.gemm_rms_bwd(x.preact, x.w_gu, *norm_bwd), x.preact, x.w_gu, x.x),
        "Brms_qkv": ("rms_bwd", lambda: s.gemm_rms_bwd(x.dqkv, x.w_qkv, *norm_bwd), x.dqkv, x.w_qkv, x.x),
        **qk_norm,
    }


def checked_stages(calls: dict, stages: list[str], flag: str) -> list[str]:
    unknown = [stage for stage in stages if stage not in calls]
    if unknown:
        raise SystemExit(f"{flag}: unknown stage(s) {unknown}; known: {' '.join(calls)}")
    return stages


def sweep(x: Inputs, device: torch.device, stages: list[str], warmup: int, iters: int) -> list[dict]:
    """Time cute GEMM stages under candidate tile configs (the winners go into
    codatrain/kernels/cute/configs.py), each next to the same GEMM alone in cuBLAS."""
    from codatrain.kernels.cute import configs

    cfg = configs.sm90_config
    candidates = {
        "128x192 pingpong c2x1": cfg(128, 192, pingpong=True, cluster_m=2, cluster_n=1),
        "192x128 pingpong c1x2": cfg(192, 128, pingpong=True, cluster_m=1, cluster_n=2),
        "128x128 pingpong c2x1": cfg(128, 128, pingpong=True, cluster_m=2, cluster_n=1),
        "128x128 pingpong c1x2": cfg(128, 128, pingpong=True, cluster_m=1, cluster_n=2),
        "128x128 coop c1x2": cfg(128, 128, pingpong=False, cluster_m=1, cluster_n=2),
        "128x256 coop c2x1": cfg(128, 256, pingpong=False, cluster_m=2, cluster_n=1),
        "256x128 coop c1x2": cfg(256, 128, pingpong=False, cluster_m=1, cluster_n=2),
        "256x128 coop c2x1": cfg(256, 128, pingpong=False, cluster_m=2, cluster_n=1),
    }
    calls = stage_gemms(get_backend("cute", device), x)
    results = []
    for stage in checked_stages(calls, stages, "--sweep") or list(calls):
        key, call, a, b, _ = calls[stage]
        chosen = configs.gemm_config(key)
        (ms_cublas,) = median_ms([lambda a=a, b=b: torch.mm(a, b)], device, warmup=warmup, iters=iters)
        print(f"sweep {stage:9s} {'cuBLAS GEMM alone':22s} {ms_cublas:8.3f} ms", flush=True)
        results.append({"stage": stage, "config": "cuBLAS GEMM alone", "ms": ms_cublas})
        for label, config in candidates.items():
            try:
                with configs.overridden(key, config):
                    (ms,) = median_ms([call], device, warmup=warmup, iters=iters)
            except Exception as exc:  # a config a kernel rejects is a result, not a crash
                print(f"sweep {stage:9s} {label:22s} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            mark = " (current)" if config == chosen else ""
            print(f"sweep {stage:9s} {label:22s} {ms:8.3f} ms  {ms / ms_cublas:6.3f} x cuBLAS{mark}",
                  flush=True)
            results.append({"stage": stage, "config": label, "ms": ms})
    return results


def rope_alone(x: Inputs, out: torch.Tensor, config: object) -> Callable[[], None]:
    """QuACK's RoPE GEMM epilogue on F4's operands and frequency table, without the rstd row scale."""
    from quack.epilogue.rotary import rope_posfreq_epi

    from codatrain.kernels.cute.gemm_stages import rope_args, rope_freq

    freq = rope_freq(x.rope["head_dim"], x.rope["rope_heads"], x.w_qkv.shape[0], x.h.device,
                     *rope_args(x.rope["rope"]))
    pos = x.positions.to(torch.float32)
    return lambda: rope_posfreq_epi(x.h, x.w_qkv.t(), out={"D": out}, config=config, tuned=False, pos=pos,
                                    freq=freq)


def ablate(x: Inputs, device: torch.device, stages: list[str], warmup: int, iters: int) -> list[dict]:
    """Split each stage's cost over cuBLAS into its parts, all at the stage's own tile config and
    timed interleaved: QuACK's plain GEMM (the mainloop and the bf16 store: what QuACK's kernel
    costs before any epilogue work), QuACK's GEMM + C (adds the read of the M × N tensor the stage's
    epilogue loads, for the stages that read one) and the stage itself (adds its epilogue math,
    its extra outputs and its row reductions)."""
    from quack.gemm_interface import gemm_tuned

    from codatrain.kernels.cute import configs

    calls = stage_gemms(get_backend("cute", device), x)
    results = []
    for stage in checked_stages(calls, stages, "--ablate") or LAYER_STAGES:
        key, call, a, b, c = calls[stage]
        config = configs.gemm_config(key)
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=device)
        fns = {
            "cuBLAS GEMM": lambda a=a, b=b: torch.mm(a, b),
            "QuACK GEMM": lambda a=a, b=b, out=out, config=config: gemm_tuned.fn(a, b, out, config=config),
        }
        if c is not None:
            fns["QuACK GEMM + C"] = lambda a=a, b=b, c=c, out=out, config=config: gemm_tuned.fn(
                a, b, out, c, config=config)
        if stage == "F4":  # which part of the epilogue: the RoPE alone, as QuACK ships it
            fns["QuACK RoPE epilogue (no rstd)"] = rope_alone(x, out, config)
        fns["stage"] = call
        try:
            times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=warmup, iters=iters),
                             strict=True))
        except Exception as exc:  # one stage's failure is a result; the others still run
            print(f"ablate {stage:9s} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        base = times["cuBLAS GEMM"]
        print(f"ablate {stage:9s} " + "  ".join(f"{name} {ms:.3f} ms ({ms / base:.3f}x)"
                                              for name, ms in times.items()), flush=True)
        results.append({"stage": stage, "config": str(config), "ms": times})
    return results


def fp8_fns(s: StageBackend, x: Inputs) -> dict[str, dict[str, Callable]]:
    """Per FP8 GEMM stage (block.precision=fp8), forward and backward: the stage, cuBLAS's FP8 GEMM
    of its shape with per-tensor and with per-row scales (`torch._scaled_mm`, the same fp32
    accumulation, no fast accumulation), and the bf16 stage."""
    from codatrain.kernels.cute import configs, fp8_bwd_stages, fp8_stages, gemm_bwd_stages, quantize

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def fp8(t: torch.Tensor, dtype: torch.dtype = e4m3) -> torch.Tensor:
        return (t.float() * (torch.finfo(dtype).max / t.float().abs().amax())).to(dtype)

    one = torch.ones((), device=x.x.device)
    h8, o8, y8 = fp8(x.h), fp8(x.attn_out), fp8(x.y)
    w_o8, w_gu8, w_down8, w_qkv8 = fp8(x.w_o), fp8(x.w_gu), fp8(x.w_down), fp8(x.w_qkv)

    def scaled_mm(a8: torch.Tensor, w8: torch.Tensor) -> dict[str, Callable]:
        rows = torch.ones(a8.shape[0], 1, device=a8.device)
        cols = torch.ones(1, w8.shape[0], device=a8.device)
        return {
            "_scaled_mm tensorwise": lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16),
            "_scaled_mm rowwise": lambda: torch._scaled_mm(a8, w8.t(), rows, cols, out_dtype=torch.bfloat16),
        }

    def residual_rms(a8: torch.Tensor, w8: torch.Tensor) -> Callable:
        outs = fp8_stages.fp8_gemm_residual_rms_outputs(a8, w8, x.x, e4m3, False)
        return lambda: fp8_stages.fp8_gemm_residual_rms(a8, w8, one, x.x, x.gamma, one, *outs, False)

    preact, y, qkv = torch.empty_like(x.preact), torch.empty_like(x.y), torch.empty_like(x.qkv)
    # Backward: gradients in e5m2, the dgrads' transposed weights (K-major B operands).
    dx8, dpre8, dqkv8 = fp8(x.x, e5m2), fp8(x.preact, e5m2), fp8(x.dqkv, e5m2)
    w_down_t8, w_gu_t8, w_qkv_t8 = (w.t().contiguous() for w in (w_down8, w_gu8, w_qkv8))
    dswiglu_out = (torch.empty_like(x.preact), torch.empty_like(x.y), torch.empty_like(x.rstd))
    dx_out, n_out = torch.empty_like(x.x), torch.empty_like(x.x)
    dgamma_partials: dict[int, torch.Tensor] = {}  # by row tiles: the sweep's tile heights differ

    def rms_bwd(dz8: torch.Tensor, w_t8: torch.Tensor) -> Callable:
        def call() -> None:
            tiles = gemm_bwd_stages.rms_bwd_row_tiles(x.m, configs.fp8_stage_config("fp8_rms_bwd", False)[0])
            if tiles not in dgamma_partials:
                dgamma_partials[tiles] = torch.empty(tiles, x.cfg.dim, device=x.x.device)
            fp8_bwd_stages.fp8_gemm_rms_bwd(dz8, w_t8, one, x.x, x.gamma, x.rstd, x.zdz, x.x, dx_out, n_out,
                                            dgamma_partials[tiles], False)
        return call

    # dSwiGLU with FP8 weight gradients: dpreact in both orientations, y token-contiguous alone.
    dx_op, w_down_op = Fp8Tensor(dx8, one, x.x.dtype), Fp8Tensor(w_down8, one, x.x.dtype, None, w_down_t8)
    dpre_to = QuantizeTo(e5m2, one, transposed=True)
    y_to = QuantizeTo(e4m3, one, transposed=True, rows=False)

    def dswiglu_in_chunks(chunks: int) -> Callable:
        return lambda: fp8_bwd_stages.fp8_dgrad_dswiglu_quantized(dx_op, w_down_op, x.preact, dpre_to, y_to,
                                                                  False, chunks)

    def dswiglu_epilogue_then_quantize() -> None:
        fp8_bwd_stages.fp8_gemm_dswiglu(dx8, w_down_t8, one, x.preact, *dswiglu_out, False)
        quantize.quantize_to(dswiglu_out[0], dpre_to)
        quantize.quantize_to(dswiglu_out[1], y_to)

    # The norm backward with FP8 weight gradients: n token-contiguous alone, dx in both orientations
    # (gate/up) or its rows alone (QKV).
    n_to = QuantizeTo(e4m3, one, transposed=True, rows=False)
    dx_both, dx_rows = QuantizeTo(e5m2, one, transposed=True), QuantizeTo(e5m2, one)
    w_gu_op, w_qkv_op = (Fp8Tensor(w8, one, x.x.dtype, None, w_t8)
                         for w8, w_t8 in ((w_gu8, w_gu_t8), (w_qkv8, w_qkv_t8)))

    def rms_bwd_one_pass(dz8: torch.Tensor, w_op: Fp8Tensor, dx_to: QuantizeTo) -> Callable:
        dz_op = Fp8Tensor(dz8, one, x.x.dtype)
        norm = (x.x, x.gamma, x.rstd, x.zdz, x.x)  # x's own gradient stands for the residual's
        return lambda: fp8_bwd_stages.fp8_dgrad_rms_bwd_quantized(dz_op, w_op, *norm, n_to, dx_to, False)

    def rms_bwd_epilogue_then_quantize(dz8: torch.Tensor, w_t8: torch.Tensor, dx_to: QuantizeTo) -> Callable:
        epilogue = rms_bwd(dz8, w_t8)

        def call() -> None:
            epilogue()
            quantize.quantize_to(dx_out, dx_to)
            quantize.quantize_to(n_out, n_to)
        return call

    rope = gemm_stages_rope_args(x)
    qk_norm = {}
    if x.cfg.qk_norm:  # Qwen3: F4 with its QK-norm
        head_dim, rope_heads, *rope_scalars = rope
        norm = {key: (torch.rand(head_dim, device=x.x.device) + 0.5).to(x.h.dtype)
                for key in ("q_weight", "k_weight")}
        z_pairs = torch.empty(2, x.m, x.qkv.shape[1] // 2, dtype=x.qkv.dtype, device=x.x.device)
        qk_norm["F4 QKV · rstd + QK-norm + RoPE"] = {
            "stage": lambda: fp8_stages.fp8_gemm_rstd_qknorm_rope(
                h8, w_qkv8, one, x.rstd, x.positions, None, norm["q_weight"], norm["k_weight"], qkv, z_pairs,
                head_dim, x.cfg.n_heads, rope_heads, EPS, *rope_scalars, False),
            **scaled_mm(h8, w_qkv8),
            "bf16 stage": lambda: s.gemm_rstd_qknorm_rope(x.h, x.w_qkv, x.rstd, x.positions, **x.rope,
                                                          q_heads=x.cfg.n_heads, eps=EPS, **norm)}
    return {
        "F1 out-proj + residual + x² → h FP8": {
            "stage": residual_rms(o8, w_o8), **scaled_mm(o8, w_o8),
            "bf16 stage": lambda: s.gemm_residual_rms(x.attn_out, x.w_o, x.x, x.gamma)},
        "F2 gate/up · rstd + SwiGLU": {
            "stage": lambda: fp8_stages.fp8_gemm_rstd_swiglu(h8, w_gu8, one, x.rstd, preact, y, False),
            **scaled_mm(h8, w_gu8), "bf16 stage": lambda: s.gemm_rstd_swiglu(x.h, x.w_gu, x.rstd)},
        "F3 down-proj + residual + x² → h FP8": {
            "stage": residual_rms(y8, w_down8), **scaled_mm(y8, w_down8),
            "bf16 stage": lambda: s.gemm_residual_rms(x.y, x.w_down, x.x, x.gamma)},
        "F4 QKV · rstd + RoPE": {
            "stage": lambda: fp8_stages.fp8_gemm_rstd_rope(h8, w_qkv8, one, x.rstd, x.positions, None, qkv,
                                                           *rope, False),
            **scaled_mm(h8, w_qkv8),
            "bf16 stage": lambda: s.gemm_rstd_rope(x.h, x.w_qkv, x.rstd, x.positions, **x.rope)},
        **qk_norm,
        "Bdswiglu down dgrad + dSwiGLU": {
            "stage": lambda: fp8_bwd_stages.fp8_gemm_dswiglu(dx8, w_down_t8, one, x.preact, *dswiglu_out,
                                                             False),
            **scaled_mm(dx8, w_down_t8), "bf16 stage": lambda: s.gemm_dswiglu(x.x, x.w_down, x.preact)},
        "Bdswiglu+Q the same, with its FP8 copies as the model asks": {
            "stage": dswiglu_in_chunks(fp8_bwd_stages.DSWIGLU_CHUNKS), **scaled_mm(dx8, w_down_t8),
            **{f"stage, {n} chunks": dswiglu_in_chunks(n) for n in (1, 2, 8)},
            "fused epilogue + quantize passes": dswiglu_epilogue_then_quantize},
        "Brms_gu gate/up dgrad + RMSNorm bwd": {
            "stage": rms_bwd(dpre8, w_gu_t8), **scaled_mm(dpre8, w_gu_t8),
            "bf16 stage": lambda: s.gemm_rms_bwd(x.preact, x.w_gu, x.x, x.gamma, x.rstd, x.zdz, x.x)},
        "Brms_qkv QKV dgrad + RMSNorm bwd": {
            "stage": rms_bwd(dqkv8, w_qkv_t8), **scaled_mm(dqkv8, w_qkv_t8),
            "bf16 stage": lambda: s.gemm_rms_bwd(x.dqkv, x.w_qkv, x.x, x.gamma, x.rstd, x.zdz, x.x)},
        "Brms_gu+Q the same, with its FP8 copies as the model asks": {
            "stage": rms_bwd_one_pass(dpre8, w_gu_op, dx_both), **scaled_mm(dpre8, w_gu_t8),
            "fused epilogue + quantize passes": rms_bwd_epilogue_then_quantize(dpre8, w_gu_t8, dx_both)},
        "Brms_qkv+Q the same, with its FP8 copies as the model asks": {
            "stage": rms_bwd_one_pass(dqkv8, w_qkv_op, dx_rows), **scaled_mm(dqkv8, w_qkv_t8),
            "fused epilogue + quantize passes": rms_bwd_epilogue_then_quantize(dqkv8, w_qkv_t8, dx_rows)},
    }


def quantize_fns(x: Inputs) -> dict[str, dict[str, Callable]]:
    """The FP8 quantize passes over what no epilogue writes in FP8 (block.precision=fp8), each
    against a bf16 copy of its input: row-major (y, the attention output: 3 bytes moved per
    element, the copy 4), and as the backward calls the transposing pass: a gradient into both
    orientations (4 bytes, as the copy), a weight for its dgrad (its amax first, then Wᵀ alone)
    and a weight gradient's activation operand into the transposed copy alone (3 bytes)."""
    from codatrain.kernels.cute import quantize

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=x.x.device)
    y_out = quantize.quantize_fp8_outputs(x.y, e4m3)
    o_out = quantize.quantize_fp8_outputs(x.attn_out, e4m3)
    both = QuantizeTo(e5m2, one, transposed=True)
    alone = QuantizeTo(e4m3, one, transposed=True, rows=False)
    preact, y, o, w_gu = (torch.empty_like(t) for t in (x.preact, x.y, x.attn_out, x.w_gu))
    return {
        "quantize y (M × F)": {
            "stage": lambda: quantize.quantize_fp8(x.y, one, *y_out), "bf16 copy": lambda: y.copy_(x.y)},
        "quantize attention output": {
            "stage": lambda: quantize.quantize_fp8(x.attn_out, one, *o_out),
            "bf16 copy": lambda: o.copy_(x.attn_out)},
        "quantize dpreact, both orientations": {
            "stage": lambda: quantize.quantize_to(x.preact, both),
            "bf16 copy": lambda: preact.copy_(x.preact)},
        "quantize y, transposed alone": {
            "stage": lambda: quantize.quantize_to(x.y, alone), "bf16 copy": lambda: y.copy_(x.y)},
        "quantize W_gu for its dgrad (amax + Wᵀ)": {
            "stage": lambda: quantize.quantize_to(x.w_gu, alone._replace(scale=None)),
            "bf16 copy": lambda: w_gu.copy_(x.w_gu)},
    }


def layout_fns(x: Inputs) -> dict[str, dict[str, Callable]]:
    """The backward's GEMMs at each layer shape as plain GEMMs in the layouts a backend could call
    them: a dgrad dz·W as the cute backend calls it (`torch.mm(dz, W)`), on a weight stored
    transposed (made once; and made at each call), and in QuACK's GEMM; the out-projection's weight
    gradient as the backend calls it (`torch.mm(dzᵀ, a)`) and as (aᵀ·dz)ᵀ made contiguous."""
    from quack.gemm_interface import gemm

    def dgrads(dz: torch.Tensor, w: torch.Tensor) -> dict[str, Callable]:
        w_t = w.t().contiguous()
        return {"mm(dz, W)": lambda: torch.mm(dz, w), "mm(dz, Wt.t())": lambda: torch.mm(dz, w_t.t()),
                "Wt made + mm": lambda: torch.mm(dz, w.t().contiguous().t()),
                "quack gemm(dz, W)": lambda: gemm(dz, w, tuned=False),
                "quack gemm(dz, Wt.t())": lambda: gemm(dz, w_t.t(), tuned=False)}

    return {
        "out-proj dgrad": dgrads(x.x, x.w_o),
        "down dgrad": dgrads(x.x, x.w_down),
        "gate/up dgrad": dgrads(x.preact, x.w_gu),
        "QKV dgrad": dgrads(x.dqkv, x.w_qkv),
        "out-proj wgrad": {"mm(dz.t(), a)": lambda: torch.mm(x.x.t(), x.attn_out),
                           "mm(a.t(), dz).t() made": lambda: torch.mm(x.attn_out.t(), x.x).t().contiguous()},
    }


# (tile_m, tile_n, cluster_m, cluster_n, pingpong, fast_accum): QuACK's FP8 mainloop promotes the
# accumulator to fp32 after every k-tile unless on fast accumulation; promoted, it holds two
# accumulators per thread, which pingpong tiles hold only 64 wide. An epilogue's staged operands
# (C, TileLoads, outputs) take shared memory from the A/B pipeline: the norm backward in 128×128
# tiles keeps 3 k-tiles in flight, in 128×96 or 128×112 five (QuACK's stage count at compile).
FP8_CANDIDATES = [(128, 128, 1, 2, False, False), (128, 96, 1, 2, False, False),
                  (128, 96, 2, 1, False, False), (128, 112, 1, 2, False, False),
                  (128, 112, 2, 1, False, False), (64, 128, 1, 2, False, False),
                  (128, 192, 1, 2, False, False), (128, 128, 1, 2, True, True)]
FP8_STAGE_KEYS = {"F1": "fp8_residual_rms", "F2": "fp8_rstd_swiglu", "F3": "fp8_residual_rms",
                  "F4": "fp8_rstd_rope", "Bdswiglu": "fp8_dswiglu", "Brms_gu": "fp8_rms_bwd",
                  "Brms_qkv": "fp8_rms_bwd"}


def overridden_call(key: str, config: object, fn: Callable, fast_accum: bool | None = None) -> Callable:
    """`fn` run with cute GEMM stage `key` under `config` (and FP8 `fast_accum` unless None)."""
    from codatrain.kernels.cute import configs

    def call() -> object:
        with configs.overridden(key, config, fast_accum=fast_accum):
            return fn()

    return call


def fp8_sweep(s: StageBackend, x: Inputs, device: torch.device, warmup: int, iters: int,
              stages: list[str]) -> dict:
    """Each FP8 GEMM stage (those named in `stages`, or all) under each candidate tile and mainloop
    (`FP8_CANDIDATES`), timed interleaved with the stage's `_scaled_mm` tensorwise; a candidate that
    fails is reported."""
    from codatrain.kernels.cute import configs

    results = {}
    for name, fns in fp8_fns(s, x).items():
        stage = name.split()[0]
        if stage not in FP8_STAGE_KEYS or (stages and stage not in stages):
            continue
        timed = {"_scaled_mm tensorwise": fns["_scaled_mm tensorwise"]}
        for tm, tn, cm, cn, pingpong, fast in FP8_CANDIDATES:
            config = configs.sm90_config(tm, tn, pingpong=pingpong, cluster_m=cm, cluster_n=cn)
            label = f"{'pp' if pingpong else 'coop'} {tm}x{tn} c{cm}x{cn} {'fast' if fast else 'promoted'}"
            timed[label] = overridden_call(FP8_STAGE_KEYS[stage], config, fns["stage"], fast)
        for label, call in list(timed.items())[1:]:
            try:
                call()
            except Exception as exc:  # a tile that does not fit is a result
                print(f"fp8 sweep {stage} {label} failed: {type(exc).__name__}"[:200])
                del timed[label]
        ms = median_ms(list(timed.values()), device, warmup=warmup, iters=iters)
        times = dict(zip(timed, ms, strict=True))
        base = times["_scaled_mm tensorwise"]
        ratios = "  ".join(f"{k} {t / base:.3f}x" for k, t in times.items())
        print(f"fp8 sweep {stage:3s} {ratios}", flush=True)
        results[name] = times
    return results


def gemm_stages_rope_args(x: Inputs) -> tuple:
    """The head_dim, rope_heads and `rope_args` of the FP8 F4 custom op for `x`'s model."""
    from codatrain.kernels.cute.gemm_stages import rope_args

    return (x.cfg.head_dim, x.cfg.n_heads + x.cfg.n_kv_heads, *rope_args(x.cfg.rope))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="cute", help="stage backend to time: cute | reference | auto")
    p.add_argument("--model", default="llama3_8b", help="model preset for the widths")
    p.add_argument("--tokens", type=int, default=8192, help="M, tokens per micro-batch")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: 4096, or --tokens when fewer)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--attention", default="auto", help="attention for the layer rows: fa4 | sdpa | auto")
    p.add_argument("--compile", action="store_true", help="also time the torch.compile'd eager block")
    p.add_argument("--sweep", nargs="*", metavar="STAGE",
                   help="time candidate GEMM configs of these cute stages (F1 F2 F3 F4 LM Bdswiglu Brms_gu "
                        "Brms_qkv, and F4qk for a QK-norm model; none: all)")
    p.add_argument("--ablate", nargs="*", metavar="STAGE",
                   help="split these cute stages' cost over cuBLAS into QuACK's plain GEMM, its GEMM + C "
                        "and the epilogue, at each stage's own config (none: the layer stages)")
    p.add_argument("--sections", nargs="*", default=["stages", "layer", "fwd_bwd"],
                   choices=["stages", "layer", "fwd_bwd", "head", "fp8", "quantize", "layouts", "qknorm",
                            "none"],
                   help="stages: every stage alone; layer: attention and the layer forward; "
                        "fwd_bwd: the layer forward + backward against eager, compile and the floor; "
                        "head: the training LM head forward + backward against its peers and floor; "
                        "fp8: the FP8 GEMM stages against cuBLAS's FP8 GEMM and the bf16 stages; "
                        "quantize: the FP8 quantize passes against a bf16 copy of their input; "
                        "layouts: the backward's plain GEMMs in other layouts and in QuACK's GEMM; "
                        "qknorm: F4 with Qwen3's QK-norm and its backward against F4 and RoPE's; "
                        "none: only --sweep / --ablate")
    p.add_argument("--head-chunks", type=int, nargs="+",
                   help="head section: chunk rows to time (default: the backend's head_chunk_rows)")
    p.add_argument("--fp8-sweep", nargs="*", metavar="STAGE",
                   help="fp8 section: also time FP8 GEMM stages (F1..F4, Bdswiglu, Brms_gu, Brms_qkv; "
                        "none named: all) under candidate tiles and FP8 mainloops")
    p.add_argument("--json", type=Path, help="write the measurements to this file")
    args = p.parse_args()
    if args.seq_len is None:  # a CPU's few tokens (the docstring's example) make one sequence
        args.seq_len = min(4096, args.tokens)
    if args.tokens % args.seq_len:
        p.error(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # torch's own error is an AssertionError
        p.error(f"--device {args.device}: no CUDA device is available here; use --device cpu (with "
                "--impl reference)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    cfg = get_preset(args.model)
    dtype = torch.bfloat16
    try:
        block = resolve_block("coda", args.impl, args.attention, device)
    except BackendUnavailableError as error:  # --impl cute (the default) on a CPU
        p.error(f"--impl {args.impl}: {error}")
    s, ref = block.stages, get_backend("reference", device)
    attention_name = block.attention
    x = Inputs(cfg, args.tokens, args.seq_len, device, dtype, s.head_chunk_rows(cfg.vocab_size))
    print(f"{args.model} M={args.tokens} impl={s.name} attention={attention_name} "
          f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)

    results = {"model": args.model, "tokens": args.tokens, "impl": s.name, "stages": [], "sweep": []}
    if args.sweep is not None:
        results["sweep"] = sweep(x, device, args.sweep, args.warmup, args.iters)
    if args.ablate is not None:
        results["ablate"] = ablate(x, device, args.ablate, args.warmup, args.iters)
    rows = []
    if "stages" in args.sections:
        rows += stage_rows(s, ref, x)
    if "layer" in args.sections:
        rows += layer_rows(s, x, device, attention_name, args.compile)
    header = (f"{'stage':44s} {'stage ms':>9s} {'GEMM ms':>9s} {'eager ms':>9s} "
              f"{'stage/GEMM':>11s} {'eager/stage':>12s}")
    lines = []
    for name, stage, floor, eager in rows:
        fns = [stage, eager] + ([floor] if floor else [])
        t_stage, t_eager, *t_floor = median_ms(fns, device, warmup=args.warmup, iters=args.iters)
        t_floor = t_floor[0] if t_floor else None
        results["stages"].append(
            {"stage": name, "stage_ms": t_stage, "gemm_ms": t_floor, "eager_ms": t_eager}
        )
        floor_txt = f"{t_floor:9.3f}" if t_floor else f"{'-':>9s}"
        ratio_txt = f"{t_stage / t_floor:11.3f}" if t_floor else f"{'-':>11s}"
        lines.append(
            f"{name:44s} {t_stage:9.3f} {floor_txt} {t_eager:9.3f} {ratio_txt} {t_eager / t_stage:12.2f}"
        )
        print(lines[-1], flush=True)
    if lines:
        print("\n" + header + "\n" + "\n".join(lines))
    if "fwd_bwd" in args.sections:
        fns = fwd_bwd_fns(s, x, device, attention_name, args.compile)
        times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                         strict=True))
        results["fwd_bwd"] = times
        print(f"\none layer forward + backward ({args.model}, M={args.tokens}, CODA impl={s.name}, "
              f"attention {attention_name}; eager/compile: SDPA)")
        print(f"{'implementation':16s} {'ms':>9s} {'/ floor':>9s} {'/ CODA':>9s}")
        for name, ms in times.items():
            print(f"{name:16s} {ms:9.3f} {ms / times['floor']:9.3f} {ms / times['CODA']:9.3f}")
    if "head" in args.sections:
        fns = head_fns(s, x, device, args.head_chunks or [x.head_chunk_rows], args.compile)
        times, failed = {}, {}
        for name, fn in fns.items():  # one by one first: a pipeline that rejects a shape is a result
            try:
                fn()
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]
        fns = {name: fn for name, fn in fns.items() if name not in failed}
        times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                         strict=True))
        peaks = {name: peak_gib(fn, device) for name, fn in fns.items()} if device.type == "cuda" else {}
        results["head"] = {"ms": times, "peak_gib": peaks, "failed": failed}
        floor = times["floor (3 cuBLAS GEMMs)"]
        print(f"\nLM head forward + backward ({args.model}, M={args.tokens}, V={cfg.vocab_size}, "
              f"d={cfg.dim})")
        print(f"{'implementation':30s} {'ms':>9s} {'/ floor':>9s} {'peak GiB':>9s}")
        for name, ms in times.items():
            print(f"{name:30s} {ms:9.3f} {ms / floor:9.3f} {peaks.get(name, float('nan')):9.2f}")
        for name, error in failed.items():
            print(f"{name:30s} failed: {error}")
    if "fp8" in args.sections:
        results["fp8"] = {}
        print(f"\nFP8 GEMM stages ({args.model}, M={args.tokens}; ratios to the first _scaled_mm or copy)")
        for name, fns in fp8_fns(s, x).items():
            times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                             strict=True))
            results["fp8"][name] = times
            base = next(ms for key, ms in times.items() if key != "stage")
            parts = (f"{key} {ms:.3f} ms ({ms / base:.3f}x)" for key, ms in times.items())
            print(f"{name:40s} " + "  ".join(parts), flush=True)
        if args.fp8_sweep is not None:
            results["fp8_sweep"] = fp8_sweep(s, x, device, args.warmup, args.iters, args.fp8_sweep)
    if "quantize" in args.sections:
        results["quantize"] = {}
        print(f"\nFP8 quantize passes ({args.model}, M={args.tokens}; ratios to a bf16 copy of the input)")
        for name, fns in quantize_fns(x).items():
            times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                             strict=True))
            results["quantize"][name] = times
            print(f"{name:40s} stage {times['stage']:.3f} ms  bf16 copy {times['bf16 copy']:.3f} ms "
                  f"({times['stage'] / times['bf16 copy']:.3f}x)", flush=True)
    if "layouts" in args.sections:
        results["layouts"] = {}
        print(f"\nThe backward's plain GEMMs in other layouts ({args.model}, M={args.tokens}; "
              "ratios to the first)")
        for name, fns in layout_fns(x).items():
            times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                             strict=True))
            results["layouts"][name] = times
            base = next(iter(times.values()))
            parts = (f"{key} {ms:.3f} ms ({ms / base:.3f}x)" for key, ms in times.items())
            print(f"{name:16s} " + "  ".join(parts), flush=True)
    if "qknorm" in args.sections:
        results["qknorm"] = {}
        print(f"\nQwen3's QK-norm ({args.model}, M={args.tokens}; ratios to the first of each group)")
        for group, fns in qknorm_fns(s, ref, x).items():
            times = dict(zip(fns, median_ms(list(fns.values()), device, warmup=args.warmup, iters=args.iters),
                             strict=True))
            hosts = {name: host_ms(fn, device) for name, fn in fns.items()}
            results["qknorm"][group] = {"ms": times, "host_ms": hosts}
            base = next(iter(times.values()))
            for name, ms in times.items():
                print(f"{group:9s} {name:32s} {ms:9.3f} ms {ms / base:7.3f}x   host {hosts[name]:7.3f} ms",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
