"""A small character-level GPT as a jaxnitro experiment (the GPU check's second model).

4 pre-LayerNorm transformer blocks, 128 wide, 4 heads, a 4x MLP, learned position
embeddings, causal self-attention, next-character cross entropy; trained on the
characters of this repository's docs (``docs/*.md``; no download). The model and its
loss are plain functions (:func:`make_gpt`, :func:`gpt_loss`) so that the hand-written
loop of ``bench/gpu_check.py`` trains exactly the same graph.

    python bench/char_gpt.py --epochs 1     # trains it and prints the history
"""

from __future__ import annotations

import argparse
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxnitro as jn

ROOT = Path(__file__).resolve().parents[1]


def corpus() -> tuple[np.ndarray, int]:
    """The docs' characters as int32 codes (bytes), and the vocabulary size (256)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32), 256


def windows(codes: np.ndarray, context: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random windows of ``context + 1`` characters: inputs ``(n, context)`` and the
    next characters ``(n, context)``."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(codes) - context - 1, n)
    idx = starts[:, None] + np.arange(context + 1)[None]
    w = codes[idx]
    return w[:, :-1], w[:, 1:]


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x):  # x: (context, width)
        h = jax.vmap(self.ln1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int, key):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.pos = 0.02 * jax.random.normal(keys[1], (context, width))
        self.blocks = [Block(width, heads, k) for k in keys[2:-1]]
        self.ln = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens):  # tokens: (context,) int -> logits (context, vocab)
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(lambda v: self.head(self.ln(v)))(x)


def make_gpt(key, vocab: int = 256, context: int = 64, width: int = 128, layers: int = 4, heads: int = 4) -> GPT:
    return GPT(vocab, context, width, layers, heads, key)


def gpt_logits(model: GPT, x):
    return jax.vmap(model)(x)


def gpt_loss(logits, y):
    """Mean next-character cross entropy, in float32 whatever the logits' dtype."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))


@jn.experiment
class CharGPT:
    """The GPT as an experiment: ``x`` (batch, context) characters, ``y`` the next ones."""

    context: jn.GraphConst[int] = 64
    width: jn.GraphConst[int] = 128
    layers: jn.GraphConst[int] = 4
    heads: jn.GraphConst[int] = 4
    batch_size: int = 32
    rows: int = 3200

    def build_data(self, dist):
        codes, _ = corpus()
        x, y = windows(codes, self.context, self.rows)
        return {"train": jn.ArraySource({"x": x, "y": y}, batch_size=self.batch_size, shuffle=True, drop_last=True)}

    def build_model(self, key):
        return make_gpt(key, 256, self.context, self.width, self.layers, self.heads)

    def forward(self, model, state, *, x):
        return gpt_logits(model, x), state

    def loss(self, logits, *, y):
        return gpt_loss(logits, y)

    def learning_rate(self):
        return 1e-3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args(argv)
    nitro = jn.train(CharGPT(), max_epochs=args.epochs, logger=None)
    print(nitro.history())


if __name__ == "__main__":
    main()
