"""The ``cute`` stage backend (`CuteStages`, backend.py): the CODA stages, forward and backward,
as Hopper kernels, and FlashAttention 4 as the ``fa4`` attention (attention.py).

Importing this package needs the cuda extras (``pip install 'codatrain[cuda]'``: CuTeDSL, QuACK,
flash-attn-4); without them the import raises ImportError, which `stages.get_backend` turns into
a BackendUnavailableError that names the fix. The backend runs on sm_90 GPUs only
(`CuteStages.unsupported_reason`).

A stage is three pieces: its epilogue (epilogues.py, or QuACK's library), an out-style custom op
(gemm_stages.py and gemm_bwd_stages.py on QuACK's GEMM; the row kernels in rowwise.py and
entry.py), and the `CuteStages` method that allocates its outputs and calls the op. Every GEMM
tile config is in configs.py; helpers shared by the stages in common.py.
"""

from __future__ import annotations

from pathlib import Path

import quack.cache

from codatrain.kernels.attention import register_attention
from codatrain.kernels.cute import attention
from codatrain.kernels.cute.backend import CuteStages
from codatrain.kernels.stages import register_backend

# QuACK keys its on-disk kernel cache on a fingerprint of its own sources; adding ours makes an
# edit to a kernel here invalidate the kernels compiled from the old version.
quack.cache.EXTRA_SOURCE_DIRS.append(Path(__file__).resolve().parent)

__all__ = ["CuteStages"]

register_backend("cute", CuteStages())
register_attention("fa4", attention.fa4_attention)
