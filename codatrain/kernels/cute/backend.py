"""`CuteStages`: every CODA stage, forward and backward, on Hopper (sm_90).

A stage is three pieces: its epilogue (epilogues.py, or QuACK's), an out-style custom op that
launches the kernel (gemm_stages.py, gemm_bwd_stages.py, rowwise.py, entry.py), and the method
here, which checks dtypes, allocates the outputs, calls the op and names the results. The fused
stages are CuTeDSL kernels (QuACK's GEMM with a CODA epilogue, or a row kernel); the rstd
reduction and the LM head's fused linear cross-entropy (head.py) are QuACK's; plain dgrad/wgrad
GEMMs, with nothing to fuse, are cuBLAS calls (faster than QuACK's untuned default at every layer
shape).

FP8 operands (`Fp8Tensor`, block.precision=fp8) take the FP8 forms of the GEMM stages
(fp8_stages.py, fp8_bwd_stages.py: QuACK's FP8 mainloop, cuBLAS FP8 for the plain GEMMs); an
output asked for in FP8 that no epilogue writes in FP8 goes through one quantize pass
(quantize.py).
"""

from __future__ import annotations

import torch

from codatrain.kernels.cute import (
    entry,
    fp8_bwd_stages,
    fp8_stages,
    gemm_bwd_stages,
    gemm_stages,
    head,
    rowwise,
)
from codatrain.kernels.cute.common import empty, padded_width, rows_of_whole_vectors
from codatrain.kernels.cute.configs import fp8_stage_config
from codatrain.kernels.cute.fp8_bwd_stages import fp8_mm, k_major_t, one_pass_dswiglu, one_pass_rms_bwd
from codatrain.kernels.cute.quantize import quantize_to
from codatrain.kernels.fp8 import Fp8Recipe, Fp8Tensor, QuantizeTo, fp8_max, scale_from_amax
from codatrain.kernels.stages import (
    IGNORE_INDEX,
    DSwigluOut,
    EntryOut,
    HeadLossOut,
    LseOut,
    QkNormBwdOut,
    QkNormOut,
    ResidualOut,
    RmsBwdFp8Out,
    RmsBwdOut,
    Rope,
    RopeBwdOut,
    StageBackend,
    SwigluOut,
    is_sm90,
)

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
STAT = torch.float32  # the statistics dtype of 16-bit activations


def _check_activations(stage: str, *tensors: torch.Tensor) -> None:
    # A plain loop: torch.compile traces this check with the stage call.
    for t in tensors:
        if t.dtype != tensors[0].dtype or t.dtype not in _ACTIVATION_DTYPES:
            got = ", ".join(str(t.dtype) for t in tensors)
            raise TypeError(f"cute {stage}: activations and weights must share one 16-bit dtype, got {got}")


def _check_fp8(stage: str, *operands: Fp8Tensor) -> None:
    for t in operands:
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"cute {stage}: an FP8 GEMM takes FP8 operands only, got {type(t).__name__}")
        if t.data.dim() == 2 and (t.data.shape[-1] % 16 or t.data.shape[0] % 16):
            raise ValueError(f"cute {stage}: FP8 operands move in 16-byte rows, in both orientations, so "
                             f"both sizes must be multiples of 16 (got {tuple(t.data.shape)}; the tokens of "
                             "a micro-batch, batch × sequence, and every layer width)")


def _ab_inv_scale(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """1/(s_a·s_b), the factor an FP8 GEMM's epilogue multiplies its sum by (a 0-d device tensor)."""
    return (a.scale * b.scale).reciprocal()


def _bias_for(dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor | None:
    """An FP8 stage's QKV bias, which must be in the dtype of the outputs (the FP8 operands'
    nominal dtype), as a 16-bit stage's bias is in its activations'."""
    if bias is not None and bias.dtype != dtype:
        raise TypeError(f"cute FP8 QKV stage: the bias must be {dtype} like the outputs, got {bias.dtype}")
    return bias


def _maybe_quantize(x: torch.Tensor, to: QuantizeTo | None) -> torch.Tensor | Fp8Tensor:
    # The stages build their outputs anew around this rather than `NamedTuple._replace`, which
    # torch 2.11's dynamo cannot return from a compiled region.
    return x if to is None else quantize_to(x, to)


def _release(x: torch.Tensor) -> None:
    """Free x's memory now, where x alone holds its storage: the caller reads it no more, though
    autograd keeps a reference to it until the backward returns (as FSDP2 frees a parameter's)."""
    storage = x.untyped_storage()
    if x.is_contiguous() and x.storage_offset() == 0 and storage.nbytes() == x.numel() * x.element_size():
        storage.resize_(0)


class CuteStages(StageBackend):
    """Every CODA stage as a Hopper kernel: CuTeDSL epilogues on QuACK's GEMM, row kernels, and
    cuBLAS for the plain dgrad/wgrad. `fp8_fast_accum` (block.fp8_fast_accum): every FP8 stage's
    mainloop on fast accumulation, not only those that meet the stage tests' criterion with it
    (configs.FP8_FAST_ACCUM)."""

    def __init__(self, fp8_fast_accum: bool = False) -> None:
        self.fp8_fast_accum = fp8_fast_accum

    def for_fp8(self, recipe: Fp8Recipe) -> CuteStages:
        return CuteStages(fp8_fast_accum=recipe.fast_accum)

    def unsupported_reason(self, device: torch.device) -> str | None:
        if not is_sm90(device):
            return "the CuTeDSL kernels target sm_90 (Hopper) GPUs"
        return None

    def entry(
        self,
        tokens: torch.Tensor,
        embedding: torch.Tensor,
        gamma: torch.Tensor,
        *,
        eps: float,
        h_fp8: QuantizeTo | None = None,
    ) -> EntryOut:
        _check_activations("entry", embedding, gamma)
        if not (embedding.is_contiguous() and gamma.is_contiguous()):
            raise ValueError("cute entry: the embedding table and gamma must be contiguous")
        m, d = tokens.shape[0], embedding.shape[1]
        out = EntryOut(empty(m, d, like=embedding), empty(m, d, like=embedding),
                       empty(m, like=embedding, dtype=STAT))
        entry.entry(tokens.contiguous(), embedding, gamma, *out, eps)
        # Once per forward: h reaches FP8 through a quantize pass.
        return EntryOut(out.x, _maybe_quantize(out.h, h_fp8), out.rstd)

    def gemm_residual_rms(
        self, a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, *,
        h_fp8: QuantizeTo | None = None,
    ) -> ResidualOut:
        if isinstance(a, Fp8Tensor):
            return self._fp8_gemm_residual_rms(a, weight, residual, gamma, h_fp8)
        _check_activations("gemm_residual_rms", a, weight, residual, gamma)
        # The partials follow the kernel's own column tile (the API allows any P).
        m, n = a.shape[0], weight.shape[0]
        tiles = gemm_stages.column_tiles(gemm_stages.residual_rms_stage(a.shape[1], n), n)
        out = ResidualOut(empty(m, n, like=a), empty(m, n, like=a), empty(m, tiles, like=a, dtype=STAT))
        gemm_stages.gemm_residual_rms(a, weight, residual, gamma, *out)
        return ResidualOut(out.x, _maybe_quantize(out.h, h_fp8), out.sq_partials)

    def _fp8_gemm_residual_rms(self, a: Fp8Tensor, weight: Fp8Tensor, residual: torch.Tensor,
                               gamma: torch.Tensor, h_fp8: QuantizeTo | None) -> ResidualOut:
        _check_fp8("gemm_residual_rms", a, weight)
        _check_activations("gemm_residual_rms", residual, gamma)
        # With a delayed scale the epilogue writes h in FP8 itself; without one (the LM head's
        # input, or current scaling in a run's first step) it writes h in the activation dtype.
        direct = h_fp8 is not None and h_fp8.scale is not None
        h_scale = h_fp8.scale if direct else torch.ones((), dtype=STAT, device=residual.device)
        x, h, sq, amax = fp8_stages.fp8_gemm_residual_rms_outputs(
            a.data, weight.data, residual, h_fp8.dtype if direct else residual.dtype, self.fp8_fast_accum)
        fp8_stages.fp8_gemm_residual_rms(a.data, weight.data, _ab_inv_scale(a, weight), residual, gamma,
                                         h_scale, x, h, sq, amax, self.fp8_fast_accum)
        h_amax = amax.amax()
        if direct:
            return ResidualOut(x, Fp8Tensor(h, h_scale, residual.dtype, h_amax), sq)
        if h_fp8 is not None:
            # Current scaling: the epilogue's max |h| partials give the scale for one quantize pass.
            # They are of h before its rounding to 16 bits, so the tensor carries that amax, the one
            # its scale came from (rounding moves |h| by at most half a bf16 ulp: h·scale still
            # rounds to at most FP8's max).
            scale = scale_from_amax(h_amax, fp8_max(h_fp8.dtype), h_fp8.margin)
            h_q = quantize_to(h, QuantizeTo(h_fp8.dtype, scale))
            return ResidualOut(x, Fp8Tensor(h_q.data, scale, h_q.dtype, h_amax, h_q.data_t), sq)
        return ResidualOut(x, h, sq)

    def rstd_from_partials(self, sq_partials: torch.Tensor, *, dim: int, eps: float) -> torch.Tensor:
        return gemm_stages.rstd_from_partials(sq_partials, dim=dim, eps=eps)

    def gemm_rstd_swiglu(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                         y_fp8: QuantizeTo | None = None) -> SwigluOut:
        m, n = h.shape[0], weight.shape[0]
        if isinstance(h, Fp8Tensor):
            _check_fp8("gemm_rstd_swiglu", h, weight)
            out = SwigluOut(empty(m, n, like=rstd, dtype=h.dtype), empty(m, n // 2, like=rstd, dtype=h.dtype))
            fp8_stages.fp8_gemm_rstd_swiglu(h.data, weight.data, _ab_inv_scale(h, weight), rstd, *out,
                                            self.fp8_fast_accum)
        else:
            _check_activations("gemm_rstd_swiglu", h, weight)
            out = SwigluOut(empty(m, n, like=h), empty(m, n // 2, like=h))
            gemm_stages.gemm_rstd_swiglu(h, weight, rstd, *out)
        # QuACK stores the gated half-width output in 16 bits only on sm_90: y is quantized after.
        return SwigluOut(out.preact, _maybe_quantize(out.y, y_fp8))

    def gemm_rstd_rope(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope: Rope,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(h, Fp8Tensor):
            _check_fp8("gemm_rstd_rope", h, weight)
            qkv = empty(h.shape[0], weight.shape[0], like=rstd, dtype=h.dtype)
            fp8_stages.fp8_gemm_rstd_rope(h.data, weight.data, _ab_inv_scale(h, weight), rstd, positions,
                                          _bias_for(h.dtype, bias), qkv, head_dim, rope_heads,
                                          *gemm_stages.rope_args(rope), self.fp8_fast_accum)
            return qkv
        _check_activations("gemm_rstd_rope", h, weight, *([] if bias is None else [bias]))
        qkv = empty(h.shape[0], weight.shape[0], like=h)
        gemm_stages.gemm_rstd_rope(
            h, weight, rstd, positions, bias, qkv, head_dim, rope_heads, *gemm_stages.rope_args(rope)
        )
        return qkv

    def gemm_rstd_qknorm_rope(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        q_heads: int,
        rope_heads: int,
        rope: Rope,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> QkNormOut:
        m, n = h.shape[0], weight.shape[0]
        if isinstance(h, Fp8Tensor):
            _check_fp8("gemm_rstd_qknorm_rope", h, weight)
            _check_activations("gemm_rstd_qknorm_rope", q_weight, k_weight, *([] if bias is None else [bias]))
            qkv = empty(m, n, like=rstd, dtype=h.dtype)
            z_pairs = empty(2, m, n // 2, like=rstd, dtype=h.dtype)
            fp8_stages.fp8_gemm_rstd_qknorm_rope(
                h.data, weight.data, _ab_inv_scale(h, weight), rstd, positions, _bias_for(h.dtype, bias),
                q_weight, k_weight, qkv, z_pairs, head_dim, q_heads, rope_heads, eps,
                *gemm_stages.rope_args(rope), self.fp8_fast_accum,
            )
            return QkNormOut(qkv, z_pairs)
        _check_activations("gemm_rstd_qknorm_rope", h, weight, q_weight, k_weight,
                           *([] if bias is None else [bias]))
        qkv, z_pairs = empty(m, n, like=h), empty(2, m, n // 2, like=h)
        gemm_stages.gemm_rstd_qknorm_rope(
            h, weight, rstd, positions, bias, q_weight, k_weight, qkv, z_pairs, head_dim, q_heads, rope_heads,
            eps, *gemm_stages.rope_args(rope),
        )
        # z as the epilogue wrote it (its even and odd column planes), which the backward reads as
        # it is: putting it in column order would be one more pass over an M × N tensor.
        return QkNormOut(qkv, z_pairs)

    def gemm_rstd(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        _check_activations("gemm_rstd", h, weight)
        # Logits rows are TMA stores: a vocabulary that is not a multiple of 8 is written into rows
        # padded to one, and the (M, V) view is returned.
        vocab = weight.shape[0]
        z = empty(h.shape[0], padded_width(vocab), like=h)[:, :vocab]
        gemm_stages.gemm_rstd(h, weight, rstd, z)
        return z

    def gemm_rstd_lse(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        targets: torch.Tensor,
        *,
        ignore_index: int = IGNORE_INDEX,
    ) -> LseOut:
        _check_activations("gemm_rstd_lse", h, weight)
        out = LseOut(empty(h.shape[0], like=h, dtype=STAT), empty(h.shape[0], like=h, dtype=STAT))
        gemm_stages.gemm_rstd_lse(h, weight, rstd, targets, *out, ignore_index)
        return out

    def lm_head_ce(
        self,
        x: torch.Tensor,
        gamma: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        eps: float,
        chunk_rows: int,
        ignore_index: int = IGNORE_INDEX,
    ) -> HeadLossOut:
        _check_activations("lm_head_ce", x, gamma, weight)
        out = head.lm_head_ce(x.contiguous(), gamma, weight, targets, eps, chunk_rows, ignore_index)
        return HeadLossOut(*out)

    def lm_head_dweight(
        self,
        dweight: torch.Tensor | None,
        last_dlogits: torch.Tensor | None,
        last_n: torch.Tensor | None,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        return head.lm_head_dweight(dweight, last_dlogits, last_n, scale, dtype)

    # ---- backward --------------------------------------------------------------------------

    def rope_bwd(
        self,
        dqkv: torch.Tensor,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope: Rope,
        bias: torch.Tensor | None = None,
        dz_fp8: QuantizeTo | None = None,
    ) -> RopeBwdOut:
        _check_activations("rope_bwd", dqkv, qkv, *([] if bias is None else [bias]))
        out = RopeBwdOut(empty(*dqkv.shape, like=dqkv), empty(dqkv.shape[0], like=dqkv, dtype=STAT))
        rowwise.rope_bwd(
            dqkv.contiguous(), qkv.contiguous(), positions, bias, *out, head_dim, rope_heads,
            *gemm_stages.rope_args(rope),
        )
        return RopeBwdOut(_maybe_quantize(out.dz, dz_fp8), out.zdz)

    def qknorm_rope_bwd(
        self,
        dqkv: torch.Tensor,
        qkv: torch.Tensor,
        z: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        q_heads: int,
        rope_heads: int,
        rope: Rope,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> QkNormBwdOut:
        _check_activations("qknorm_rope_bwd", dqkv, qkv, z, q_weight, k_weight,
                           *([] if bias is None else [bias]))
        m, n = dqkv.shape
        if z.shape != (2, m, n // 2):
            raise ValueError("cute qknorm_rope_bwd: z must be the cute forward's column planes, (2, M, N/2) "
                             f"= (2, {m}, {n // 2}), got {tuple(z.shape)}")
        out = QkNormBwdOut(empty(m, n, like=dqkv), empty(m, like=dqkv, dtype=STAT), None, None)
        partials = empty(rowwise.qknorm_blocks(m), rowwise.QKNORM_PARTIAL_COLS, like=dqkv, dtype=STAT)
        rowwise.qknorm_rope_bwd(
            dqkv.contiguous(), z.contiguous(), positions, q_weight.to(STAT), k_weight.to(STAT), bias, out.dz,
            out.zdz, partials, head_dim, q_heads, rope_heads, eps, *gemm_stages.rope_args(rope),
        )
        return QkNormBwdOut(out.dz, out.zdz, *rowwise.qknorm_weight_grads(partials, head_dim))

    def bias_grad(self, dz: torch.Tensor) -> torch.Tensor:
        # One column-sum pass over dz (M × N_qkv), in fp32.
        return dz.sum(0, dtype=STAT)

    def row_dot(self, z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        _check_activations("row_dot", z, dz)
        zdz = empty(z.shape[0], like=z, dtype=STAT)
        rowwise.row_dot(z.contiguous(), dz.contiguous(), zdz)
        return zdz

    def gemm_rms_bwd(
        self,
        dz: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        gamma: torch.Tensor,
        rstd: torch.Tensor,
        zdz: torch.Tensor,
        residual_grad: torch.Tensor | None = None,
    ) -> RmsBwdOut:
        extra = () if residual_grad is None else (residual_grad,)
        if isinstance(dz, Fp8Tensor):
            return self._fp8_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)
        _check_activations("gemm_rms_bwd", dz, weight, x, gamma, *extra)
        # dz is the dgrad's K-major A operand: its rows must be 16-byte TMA rows (the full-logits
        # head's dlogits over a vocabulary that is not a multiple of 8 are not).
        dz = rows_of_whole_vectors(dz)
        # The dγ partials follow the kernel's own row tile (the API allows any P_m).
        m, d = x.shape
        tiles = gemm_bwd_stages.rms_bwd_row_tiles(m)
        out = RmsBwdOut(empty(m, d, like=x), empty(m, d, like=x), empty(tiles, d, like=x, dtype=STAT))
        gemm_bwd_stages.gemm_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad, *out)
        return out

    def _fp8_rms_bwd(self, dz: Fp8Tensor, weight: Fp8Tensor, x: torch.Tensor, gamma: torch.Tensor,
                     rstd: torch.Tensor, zdz: torch.Tensor, residual_grad: torch.Tensor | None) -> RmsBwdOut:
        _check_fp8("gemm_rms_bwd", dz, weight)
        _check_activations("gemm_rms_bwd", x, gamma, *(() if residual_grad is None else (residual_grad,)))
        m, d = x.shape
        tiles = gemm_bwd_stages.rms_bwd_row_tiles(m, fp8_stage_config("fp8_rms_bwd", self.fp8_fast_accum)[0])
        out = RmsBwdOut(empty(m, d, like=x), empty(m, d, like=x), empty(tiles, d, like=x, dtype=STAT))
        fp8_bwd_stages.fp8_gemm_rms_bwd(dz.data, k_major_t(weight), _ab_inv_scale(dz, weight), x, gamma,
                                        rstd, zdz, residual_grad, *out, self.fp8_fast_accum)
        return out

    def gemm_rms_bwd_fp8(
        self,
        dz: Fp8Tensor,
        weight: Fp8Tensor,
        x: torch.Tensor,
        gamma: torch.Tensor,
        rstd: torch.Tensor,
        zdz: torch.Tensor,
        residual_grad: torch.Tensor | None = None,
        *,
        n_fp8: QuantizeTo,
        dx_fp8: QuantizeTo | None = None,
    ) -> RmsBwdFp8Out:
        if one_pass_rms_bwd(n_fp8, dx_fp8):
            _check_fp8("gemm_rms_bwd", dz, weight)
            _check_activations("gemm_rms_bwd", x, gamma, *(() if residual_grad is None else (residual_grad,)))
            return RmsBwdFp8Out(*fp8_bwd_stages.fp8_dgrad_rms_bwd_quantized(
                dz, weight, x, gamma, rstd, zdz, residual_grad, n_fp8, dx_fp8, self.fp8_fast_accum))
        # dx and n leave the epilogue in the activation dtype: the wgrad reads n token-contiguous,
        # and dx feeds the residual path as well as the next dgrad.
        dx, n, dgamma_partials = self._fp8_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)
        return RmsBwdFp8Out(dx, _maybe_quantize(dx, dx_fp8), quantize_to(n, n_fp8), dgamma_partials)

    def gemm_dswiglu(self, dout: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, *,
                     dpreact_fp8: QuantizeTo | None = None, y_fp8: QuantizeTo | None = None,
                     reuse_preact: bool = False) -> DSwigluOut:
        m, f2 = preact.shape
        if isinstance(dout, Fp8Tensor) and one_pass_dswiglu(dpreact_fp8, y_fp8):
            _check_fp8("gemm_dswiglu", dout, weight)
            _check_activations("gemm_dswiglu", preact)
            # dpreact's FP8 copies need memory of their own here (the pass reads preact as it
            # writes them), where the dgrad's chunks keep the stage's maximum under the fused one's.
            out = DSwigluOut(*fp8_bwd_stages.fp8_dgrad_dswiglu_quantized(
                dout, weight, preact.contiguous(), dpreact_fp8, y_fp8, self.fp8_fast_accum))
            if reuse_preact:
                _release(preact)
            return out
        out = DSwigluOut(empty(m, f2, like=preact), empty(m, f2 // 2, like=preact),
                         empty(m, like=preact, dtype=STAT))
        if isinstance(dout, Fp8Tensor):
            _check_fp8("gemm_dswiglu", dout, weight)
            _check_activations("gemm_dswiglu", preact)
            fp8_bwd_stages.fp8_gemm_dswiglu(dout.data, k_major_t(weight), _ab_inv_scale(dout, weight),
                                            preact, *out, self.fp8_fast_accum)
        else:
            _check_activations("gemm_dswiglu", dout, weight, preact)
            gemm_bwd_stages.gemm_dswiglu(dout, weight, preact, *out)
        # Quantized one at a time, each 16-bit tensor dropped once its FP8 copy exists: at 8B widths
        # dpreact is 0.9 GiB in bf16 (as much again in FP8, two orientations), y half that (its
        # transposed FP8 copy a quarter). When preact's memory may hold dpreact's copies, dpreact
        # goes first (it then needs no new memory); else y, the smaller copy.
        dpreact, y, zdz = out
        del out
        if dpreact_fp8 is not None and reuse_preact:
            dpreact, dpreact_fp8 = quantize_to(dpreact, dpreact_fp8, into=preact), None
        y = _maybe_quantize(y, y_fp8)
        return DSwigluOut(_maybe_quantize(dpreact, dpreact_fp8), y, zdz)

    def dgrad(self, dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(dz, Fp8Tensor):
            _check_fp8("dgrad", dz, weight)
            return fp8_mm(dz.data, dz.scale.reciprocal(), k_major_t(weight), weight.scale.reciprocal(),
                          dz.dtype)
        _check_activations("dgrad", dz, weight)
        return gemm_bwd_stages.dgrad(dz, weight)

    def wgrad(
        self, dz: torch.Tensor, a: torch.Tensor, *, accumulate_into: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(dz, Fp8Tensor):
            if accumulate_into is not None:
                raise ValueError("cute wgrad: FP8 operands do not accumulate into a sum")
            _check_fp8("wgrad", dz, a)
            # Both operands contract over the tokens: token-contiguous copies of each.
            return fp8_mm(k_major_t(dz), dz.scale.reciprocal(), k_major_t(a), a.scale.reciprocal(),
                          dz.dtype)
        _check_activations("wgrad", dz, a)
        if accumulate_into is None:
            return gemm_bwd_stages.wgrad(dz, a)
        gemm_bwd_stages.wgrad_accumulate(dz, a, accumulate_into)
        return accumulate_into

    def quantize(self, x: torch.Tensor, to: QuantizeTo) -> Fp8Tensor:
        _check_activations("quantize", x)
        return quantize_to(x.contiguous(), to)

    def entry_bwd(self, dx: torch.Tensor, tokens: torch.Tensor, *, num_embeddings: int) -> torch.Tensor:
        if dx.dtype not in _ACTIVATION_DTYPES:
            raise TypeError(f"cute entry_bwd: the gradient must be 16-bit, got {dx.dtype}")
        # The table starts at zero: rows of tokens absent from the batch get no gradient. It sums
        # in fp32 and is rounded once.
        grad = torch.zeros(num_embeddings, dx.shape[1], dtype=STAT, device=dx.device)
        entry.entry_bwd(dx.contiguous(), tokens.contiguous(), grad)
        return grad.to(dx.dtype)
