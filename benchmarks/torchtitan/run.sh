#!/usr/bin/env bash
# torchtitan 0.3.0 as an external reference at codatrain's llama3_1b shape (README.md here).
# Run on the GPU machine from the repository root, after `bash benchmarks/torchtitan/prepare.sh` on a
# machine with the package index (wheels into .devdeps/torchtitan/) and `source .devdeps/activate.sh`:
#     bash benchmarks/torchtitan/run.sh
# Shape: dim 2048, 16 layers, 32 heads / 8 KV heads, ffn 8192, vocab 128256, rope_theta 5e5,
# untied head; seq 8192 x micro-batch 4 = 32768 tokens/step, no grad accumulation; bf16 params via
# FSDP2 MixedPrecisionPolicy (fp32 master, fp32 reduce), fully_shard on 1 rank; per-TransformerBlock
# torch.compile (+ compiled loss); no activation checkpointing; fused AdamW; synthetic tokens.
#
# Knobs (environment):
#   TT_VARIANTS   space-separated runs, default "ce".  Known:
#                   ce          plain CE loss, CUDA graphs off (the reference row)
#                   ce_graphs   plain CE loss, torchtitan's CUDA-graph step on (its 0.3.0 default)
#                   chunked     torchtitan's default ChunkedLossWrapper (expected to fail on torch 2.11)
#   TT_STEPS (30)  TT_ATTN (flex | flex_flash | varlen)  TT_TIMEOUT per run in s (420)
# Logs: $OUT/torchtitan.log for the first variant, $OUT/torchtitan_<variant>.log for the others
# (/tmp/tt-logs when OUT is unset); a summary (median tps/MFU over steps 11.., peak memory) at the end.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # the config registry, launcher and shims
WHEELS=${TT_WHEELS:-.devdeps/torchtitan}
[ -n "$(ls "$WHEELS"/*.whl 2>/dev/null)" ] || { echo "run.sh: no wheels in $WHEELS: run benchmarks/torchtitan/prepare.sh" >&2; exit 2; }
LOGDIR=${OUT:-/tmp/tt-logs}; mkdir -p "$LOGDIR"
SITE=/tmp/tt-site
: > "$LOGDIR/torchtitan.log"; : > "$LOGDIR/torchtitan_summary.log"
die() { echo "run_torchtitan.sh: FATAL: $*" | tee -a "$LOGDIR/torchtitan.log" >&2; exit 2; }

# 1. wheels (pure Python, no deps resolution: everything else is on the image or in .devdeps/wheels)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl \
  || die "pip install of $WHEELS/*.whl into $SITE failed"
# typeguard 4.6 / tyro 1.0 need typing_extensions >= 4.14; carry ours only if the image's is older
if ! python3 -c "import importlib.metadata as m,sys; v=tuple(int(x) for x in m.version('typing_extensions').split('.')[:2]); sys.exit(v<(4,14))" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/optional/typing_extensions-*.whl \
    || die "typing_extensions install failed"
fi
# /tmp/tt-site first: its datasets 4.7.0 (torchtitan pins <4.8) shadows .devdeps' datasets 5.x
export PYTHONPATH="$SITE:$D:${PYTHONPATH:-}"

# 2. preflight: every import torchtitan needs, the config parse, and the model shape, in one process
python3 - <<'PY' 2>&1 | tee "$LOGDIR/torchtitan_preflight.log"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import tt_compat, tt_codatrain, torchtitan, torchtitan.train, datasets, tyro, torchdata, spmd_types
print("torchtitan", torchtitan.__version__, torchtitan.__file__, "| datasets", datasets.__version__, datasets.__file__)
from torchtitan.config import ConfigManager
cfg = ConfigManager().parse_args(["--module", "tt_codatrain", "--config", "codatrain_llama3_1b"])
m = cfg.model_spec.model
print("shape: dim", m.dim, "layers", len(m.layers), "vocab", m.vocab_size, "tied", m.enable_weight_tying,
      "| batch", cfg.training.local_batch_size, "x seq", cfg.training.seq_len, "| compile", cfg.compile,
      "| AC", cfg.activation_checkpoint, "| loss", type(cfg.loss).__qualname__)
assert torch.cuda.is_available(), "no CUDA device"
print("PREFLIGHT OK")
PY
grep -q "PREFLIGHT OK" "$LOGDIR/torchtitan_preflight.log" || die "preflight failed (see torchtitan_preflight.log above)"

# 3. runs
CMD=(torchrun --standalone --nproc_per_node=1 "$D/tt_launch.py" --module tt_codatrain --config codatrain_llama3_1b
     --training.steps "${TT_STEPS:-30}" --metrics.disable_color_printing)
first=1; main_rc=
for v in ${TT_VARIANTS:-ce}; do
  case $v in
    ce)        export TT_LOSS=ce      TT_CUDA_GRAPHS=0 ;;
    ce_graphs) export TT_LOSS=ce      TT_CUDA_GRAPHS=1 ;;
    chunked)   export TT_LOSS=chunked TT_CUDA_GRAPHS=0 ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  if [ $first = 1 ]; then log="$LOGDIR/torchtitan.log"; else log="$LOGDIR/torchtitan_$v.log"; fi; first=0
  export TT_DUMP=/tmp/tt-out-$v
  { echo "== variant $v: TT_LOSS=$TT_LOSS TT_CUDA_GRAPHS=$TT_CUDA_GRAPHS TT_ATTN=${TT_ATTN:-flex}"
    echo "== command: PYTHONPATH=$PYTHONPATH TT_LOSS=$TT_LOSS TT_CUDA_GRAPHS=$TT_CUDA_GRAPHS TT_ATTN=${TT_ATTN:-flex} NCCL_NVLS_ENABLE=0 ${CMD[*]}"; } | tee -a "$log"
  timeout "${TT_TIMEOUT:-420}" "${CMD[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}; echo "== variant $v exit $rc" | tee -a "$log"
  [ -z "$main_rc" ] && main_rc=$rc
  # summary from torchtitan's own per-step lines
  python3 - "$log" "$v" <<'PY' | tee -a "$LOGDIR/torchtitan_summary.log"
import re, statistics, sys
path, v = sys.argv[1], sys.argv[2]
txt = re.sub(r"\x1b\[[0-9;]*m", "", open(path, errors="replace").read())
steps = [(int(s), float(l), float(mem), int(t.replace(",", "")), float(tf.replace(",", "")), float(mfu))
         for s, l, mem, t, tf, mfu in re.findall(
             r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([-\d.]+)GiB.*?tps:\s*([\d,]+)\s+tflops:\s*([\d.,]+)\s+mfu:\s*([\d.]+)%", txt)]
act = [float(a) for a in re.findall(r"\[tt-mem\] max_active: ([-\d.]+)GiB", txt)]
if not steps:
    print(f"== summary {v}: no step lines"); sys.exit()
timed = [s for s in steps if s[0] > 10] or steps
print(f"== summary {v}: steps {len(steps)} (timed {timed[0][0]}..{timed[-1][0]}), "
      f"median tps {statistics.median(s[3] for s in timed):,.0f}, median tflops {statistics.median(s[4] for s in timed):.1f}, "
      f"median mfu {statistics.median(s[5] for s in timed):.2f}%, peak max_reserved {max(s[2] for s in steps):.2f}GiB, "
      f"peak max_active {max(act) if act else float('nan'):.2f}GiB, final loss {steps[-1][1]:.4f}")
PY
done
echo; echo "== all variants"; cat "$LOGDIR/torchtitan_summary.log"
exit "${main_rc:-3}"
