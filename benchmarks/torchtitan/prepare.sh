#!/usr/bin/env bash
# Download, on a machine with the package index, the pure-Python wheels torchtitan 0.3.0 needs and
# the GPU machine's image lacks, into .devdeps/torchtitan/ (carried to the GPU machine with .devdeps).
# Run from the repository root: bash benchmarks/torchtitan/prepare.sh
set -euo pipefail
dest=.devdeps/torchtitan
mkdir -p "$dest/optional"
# torchtitan pins datasets < 4.8 (run.sh puts these first on PYTHONPATH, over .devdeps' datasets).
pip download -q --no-deps -d "$dest" torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 \
    tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 datasets==4.7.0
# typeguard 4.6 and tyro 1.0 need typing_extensions >= 4.14; run.sh installs it only where the image's is older.
pip download -q --no-deps -d "$dest/optional" typing_extensions==4.16.0
du -sh "$dest"
