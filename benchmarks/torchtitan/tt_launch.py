"""Entry point: apply tt_compat, make torchtitan's per-step line also report max_active memory
(≈ max allocated) next to its max_reserved, then run torchtitan.train.main() unchanged."""
import tt_codatrain  # noqa: F401  (applies tt_compat; lets --module tt_codatrain resolve here)
from torchtitan.components import metrics as _m
from torchtitan.tools.logging import logger

_orig = _m.DeviceMemoryMonitor.get_peak_stats


def _get_peak_stats(self):
    s = _orig(self)
    logger.info(f"[tt-mem] max_active: {s.max_active_gib:.2f}GiB  max_reserved: {s.max_reserved_gib:.2f}GiB  "
                f"alloc_retries: {s.num_alloc_retries}  ooms: {s.num_ooms}")
    return s


_m.DeviceMemoryMonitor.get_peak_stats = _get_peak_stats

if __name__ == "__main__":
    from torchtitan.train import main
    main()
