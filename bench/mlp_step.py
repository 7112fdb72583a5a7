"""The hand-written baseline's model and train step, shared by the benches.

The tutorial's MLP (784-width-10, ReLU) as two ``eqx.nn.Linear`` layers, partitioned
ONCE into arrays and static structure, label-smoothed softmax cross entropy, and one
optax update: what a careful user writes without a framework. It imports no jaxnitro,
so ``bench/first_step.py`` can time a process that never loads it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

SMOOTHING = 0.05


def make_step(seed: int = 0, width: int = 128, opt=None, compute_dtype=None):
    """``(params, opt_state, step)`` for the MLP: ``step(params, opt_state, x, y) -> (params,
    opt_state, loss)``, not jitted (the caller jits it, with its own shardings or donation).
    ``opt``: an optax transformation (default ``optax.radam(1e-3)``). ``compute_dtype``
    (e.g. ``jnp.bfloat16``): the forward and backward run in it, by hand, as mixed precision
    is usually written: the float32 params and ``x`` cast inside the step, the logits cast
    back to float32 before the loss; the gradient reaches the optimizer in float32."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    model = (eqx.nn.Linear(784, width, key=k1), eqx.nn.Linear(width, 10, key=k2))
    params, static = eqx.partition(model, eqx.is_inexact_array)  # once, not per step
    opt = optax.radam(1e-3) if opt is None else opt

    def loss_fn(params, x, y):
        if compute_dtype is not None:
            params = jax.tree_util.tree_map(lambda a: a.astype(compute_dtype), params)
            x = x.astype(compute_dtype)
        l1, l2 = eqx.combine(params, static)
        logits = jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(x).astype(jnp.float32)
        target = (1.0 - SMOOTHING) * y + SMOOTHING / y.shape[-1]
        return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1)) / x.shape[0]

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return params, opt.init(params), step


def endless_batches(source):
    """The batches of an index-addressable ``source`` (``begin_epoch``/``batch_at``), epoch
    after epoch, as a hand-written loop reads them."""
    epoch = 0
    while True:
        source.begin_epoch(epoch)
        for i in range(len(source)):
            yield source.batch_at(i)
        epoch += 1
