"""Run training (scripts/train.py's `train`) and record every training batch a rank is handed:
`python -m torch.distributed.run ... tests/stream_recorder.py <out dir> <overrides...>` writes
<out dir>/rank<r>.npy, the (batches, micro-batch, seq_len) inputs in order."""

import os
import sys
from pathlib import Path

import numpy as np

from codatrain.config import load_config
from codatrain.data.streaming import StreamLoader
from codatrain.train.trainer import train


def main(out: str, overrides: list[str]) -> None:
    recorded, original = [], StreamLoader.__iter__

    def recording(self):
        for batch in original(self):
            recorded.append(batch.inputs.numpy().copy())
            yield batch

    StreamLoader.__iter__ = recording
    train(load_config(overrides))
    np.save(Path(out) / f"rank{os.environ.get('RANK', '0')}.npy", np.stack(recorded))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
