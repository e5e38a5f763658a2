"""The CODA stage API (`codatrain.kernels.stages`) and its backends: `reference` (pure PyTorch)
and `cute` (CuTeDSL/QuACK kernels for sm_90 GPUs, in `codatrain.kernels.cute`)."""
