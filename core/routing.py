"""Routing batch fields to hooks by their keyword-only parameters.

A hook declares the batch fields it wants as keyword-only parameters::

    def loss(self, outputs, *, label, weight=None): ...

``label`` is required, ``weight`` optional. Signatures are read once at setup
into :class:`Route` objects; a field no hook declares never leaves the host.

The keyword ``key`` is reserved: a traced hook that declares it receives a
``jax.random`` key from the framework (distinct for every micro-batch, derived
from the run's ``seed``), e.g. for ``eqx.nn.Dropout``. It is not a batch field.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

__all__ = ["Route", "route_of", "check_reserved_fields", "BatchFieldError", "KEY", "KEY_DATA", "KEY_COUNT"]

KEY = "key"
"""The reserved keyword through which traced hooks receive a PRNG key."""
KEY_DATA = "__jaxnitro_key_data__"
KEY_COUNT = "__jaxnitro_key_count__"
"""Batch entries the framework adds when a hook wants a key: the run's base key and a counter."""


class BatchFieldError(KeyError):
    """A hook needs a batch field the batch does not have."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


@dataclass(frozen=True)
class Route:
    """The batch fields one hook receives: ``required`` and ``optional`` (has a default)."""

    hook: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    wants_key: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional

    def check(self, batch_fields, where: str = "the batch") -> None:
        """Raise :class:`BatchFieldError` if a required field is missing from ``batch_fields``
        (``where`` names the batch in the message, e.g. "the `val` split's first batch")."""
        missing = [f for f in self.required if f not in batch_fields]
        if missing:
            raise BatchFieldError(
                f"jaxnitro: hook `{self.hook}` requires batch field(s) {missing} but {where} "
                f"has {sorted(batch_fields)}. The hook declares {list(self.required)} as required "
                f"keyword-only parameters{' and ' + str(list(self.optional)) + ' as optional' if self.optional else ''}. "
                f"Fix: have the data source yield a field of that name, rename the hook's "
                f"keyword to match the batch, or give the keyword a default to make it optional."
            )

    def select(self, batch: dict) -> dict:
        """The subset of ``batch`` this hook receives (optional fields only when present),
        plus the framework's ``key`` when the hook declares one."""
        out = {f: batch[f] for f in self.fields if f in batch}
        if self.wants_key:
            out[KEY] = batch[KEY]
        return out


def route_of(hook: str, function) -> Route:
    """Read the keyword-only parameters of ``function`` into a :class:`Route`.

    ``**kwargs`` is refused: routing must know the field names at setup.
    """
    sig = inspect.signature(function)
    required, optional = [], []
    wants_key = False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name == KEY:
            wants_key = True
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            (optional if p.default is not inspect.Parameter.empty else required).append(p.name)
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            raise TypeError(
                f"jaxnitro: hook `{hook}` takes **{p.name}; batch fields are routed by name, so "
                f"declare each field it uses as a keyword-only parameter (`def {hook}(self, ..., *, "
                f"img, label)`)."
            )
    return Route(hook, tuple(required), tuple(optional), wants_key)


def check_reserved_fields(batch_fields, routes: dict, where: str) -> None:
    """Refuse a batch field named ``key`` when a traced hook declares the keyword ``key``.

    That hook receives the framework's PRNG key through ``key``, never the column: the
    column would be silently replaced. Raises ``ValueError`` naming the hooks, ``where``
    (e.g. "the `train` split's first batch") and the fix.
    """
    if KEY not in batch_fields:
        return
    wanting = [h for h, r in routes.items() if r.wants_key]
    if wanting:
        raise ValueError(
            f"jaxnitro: {where} has a field named `{KEY}`, but `{KEY}` is reserved: hook(s) "
            f"{wanting} declare the keyword `{KEY}` and receive the framework's PRNG key there, so "
            f"the column would be silently replaced. Fix: rename the column (e.g. `sample_key`) and "
            f"declare that name in the hooks that read it."
        )
