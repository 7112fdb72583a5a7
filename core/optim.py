"""The optimizer: parameter groups, optax rules, decoupled decay and injected hyperparameters.

Every group gets ``optax.inject_hyperparams(rule)`` with two hyperparameters,
``learning_rate`` and ``weight_decay`` (decoupled, scaled by the rate as in
AdamW), plus each of the rule's own hyperparameters that a schedule drives
(``b1`` of Adam, ``momentum`` of SGD: :func:`rule_hypers`; which ones are injected is
part of the program's key, their values are not). Their values enter the optimizer program each step as one small
float32 vector (:class:`HyperLayout` says which slot is which), so a constant,
a schedule and a changed schedule all run the same compiled program.

Gradient clipping (``optax.clip_by_global_norm`` over the accumulated
gradient) is built inside the program with its threshold read from a slot of
that vector: whether clipping is on is part of the program's key, the
threshold is not, so a new threshold compiles nothing.

A group whose ``decay_anchor`` is ``"w0"`` decays toward an anchor (L2-SP)
rather than toward zero: the anchor is a copy of the initial (or transferred)
weights kept in that group's optimizer state (:class:`AnchorState`).

With ``ema=jn.EMA(decay)`` the chain ends with :func:`ema_params`, so the optimizer state
is ``(rule state, EmaState)``: the update itself moves the average, its decay read from the
hyperparameter vector (a new decay compiles nothing); :func:`ema_of` reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .cache import stable_key
from .plugin_manager import takes_positionals

__all__ = [
    "GroupSpec", "OptimizerSpec", "HyperLayout", "rule_hypers", "AnchorState", "EmaState", "keypath_of",
    "build_optimizer_spec", "init_opt_state", "ema_params", "ema_track", "ema_of", "rule_state_of", "with_parts",
]

HYPERS = ("learning_rate", "weight_decay")
ANCHORS = ("zero", "w0")


class AnchorState(NamedTuple):
    """The weights an L2-SP group's decay pulls toward (``decay_anchor`` = ``"w0"``)."""

    anchor: Any


class EmaState(NamedTuple):
    """:func:`ema_params`' state: the exponential moving average of the parameters."""

    params_ema: Any


def _copy(tree):
    # a copy, never an alias: the train step donates the params and the optimizer state
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def decay_toward_anchor(weight_decay) -> optax.GradientTransformation:
    """``updates + weight_decay * (params - anchor)``; the anchor is the params given to ``init``."""

    def init(params):
        return AnchorState(_copy(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("decay toward an anchor needs the params")
        updates = jax.tree_util.tree_map(
            lambda u, p, a: u + (weight_decay * (p - a)).astype(u.dtype), updates, params, state.anchor
        )
        return updates, state

    return optax.GradientTransformation(init, update)


def keypath_of(path) -> tuple:
    """Turn a JAX key path into a plain tuple of ``str`` (attributes, dict keys) and ``int``."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(k.key)
        else:
            out.append(str(k))
    return tuple(out)


@dataclass(frozen=True)
class GroupSpec:
    """One parameter group: its rule factory, base ratio, decay and size."""

    name: str
    rule: Callable
    ratio: float
    weight_decay: float
    n_params: int
    anchor: str = "zero"
    scheduled: tuple[str, ...] = ()
    """The rule's own hyperparameters that a schedule drives (``("b1",)``): injected as inputs
    of the program next to ``learning_rate`` and ``weight_decay`` (:func:`rule_hypers`)."""

    @property
    def rule_name(self) -> str:
        return getattr(self.rule, "__name__", repr(self.rule))

    @property
    def hypers(self) -> tuple[str, ...]:
        """The group's slots in the hyperparameter vector: ``HYPERS``, then :attr:`scheduled`."""
        return HYPERS + self.scheduled

    @property
    def schedulable(self) -> tuple[str, ...]:
        """Every hyperparameter a schedule may bind for this group: ``learning_rate``,
        ``weight_decay`` (decoupled) and the rule's own (:func:`rule_hypers`)."""
        return HYPERS + tuple(h for h in rule_hypers(self.rule) if h not in HYPERS)


def rule_hypers(rule) -> dict[str, float]:
    """The rule factory's own schedulable hyperparameters and their defaults: ``{"b1": 0.9,
    "b2": 0.999, "eps": 1e-08, "eps_root": 0.0}`` for ``optax.adam``, ``{"momentum": 0.0}`` for
    ``optax.sgd``.

    The parameters of ``rule``'s signature, ``learning_rate`` aside, that
    ``optax.inject_hyperparams`` would inject as numbers: a default that is a real number (not a
    bool), or a default of ``None`` whose annotation names ``float`` (SGD's ``momentum``; its
    placeholder is ``0.0``, always overwritten by the schedule). Dtypes, flags and ``*args``
    are not schedulable. A rule whose signature cannot be read (a builtin) has none."""
    import inspect
    import numbers

    try:
        params = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
        return {}
    out = {}
    for p in params:
        if p.name == "learning_rate" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        d = p.default
        if isinstance(d, numbers.Real) and not isinstance(d, (bool, np.bool_)):
            out[p.name] = float(d)
        elif d is None and "float" in str(p.annotation):
            out[p.name] = 0.0
    return out


@dataclass(frozen=True)
class HyperLayout:
    """Slots of the per-step hyperparameter vector: ``slots[i] == (group, hyper)``, then the
    gradient-clipping threshold, then (with EMA on) the EMA decay."""

    slots: tuple[tuple[str, str], ...]
    ema: bool = False

    @property
    def clip_index(self) -> int:
        """The slot after the groups' holds the gradient-clipping threshold."""
        return len(self.slots)

    @property
    def ema_index(self) -> int:
        """The last slot holds the EMA decay (with EMA on)."""
        return len(self.slots) + 1

    @property
    def size(self) -> int:
        return len(self.slots) + 1 + int(self.ema)


@dataclass(frozen=True)
class OptimizerSpec:
    """Everything the optimizer program is built from (its cache key is :meth:`key`)."""

    groups: tuple[GroupSpec, ...]
    labels: object  # pytree of group names, same structure as the trainable params
    clip_norm: float
    layout: HyperLayout
    ema_decay: float | None = None
    base_lr: float = 1e-3  # the experiment's `learning_rate()`, checked

    def key(self) -> tuple:
        return (
            tuple((g.name, stable_key(g.rule), g.anchor, g.scheduled) for g in self.groups),
            tuple(jax.tree_util.tree_leaves(self.labels)),
            self.clips,
            self.ema,
        )

    @property
    def ema(self) -> bool:
        """Whether the train step keeps a moving average of the params (its decay is an input)."""
        return self.ema_decay is not None

    @property
    def anchored(self) -> bool:
        """Whether a group decays toward its initial weights (L2-SP)."""
        return any(g.anchor == "w0" for g in self.groups)

    @property
    def clips(self) -> bool:
        """Whether the program clips the gradient (its threshold is an input, not part of the key)."""
        return bool(self.clip_norm and self.clip_norm > 0)

    def transformation(self) -> optax.GradientTransformationExtraArgs:
        """The optax transformation: one injected rule per group (clipping is applied before
        it), then :func:`ema_params` with EMA on; ``update`` takes the step's ``hypers=``."""
        per_group = {}
        for g in self.groups:
            defaults = rule_hypers(g.rule)
            per_group[g.name] = optax.inject_hyperparams(_decoupled(g.rule, g.anchor, g.scheduled))(
                learning_rate=np.asarray(g.ratio, np.float32),
                weight_decay=np.asarray(g.weight_decay, np.float32),
                **{h: np.asarray(defaults[h], np.float32) for h in g.scheduled},
            )
        if len(per_group) == 1:  # one group: no masking machinery in the program or the state
            (tx,) = per_group.values()
        else:
            labels = self.labels  # an eqx.Module is callable: hand optax a function, not the tree
            tx = optax.multi_transform(per_group, lambda _params: labels)
        tx, i = _fed(tx, self), self.layout.ema_index
        return optax.chain(tx, ema_params(lambda hypers, **_: hypers[i])) if self.ema else tx

    def clip(self, grads, vector):
        """Clip ``grads`` by global norm at the threshold in ``vector`` (traced), if clipping is on."""
        if not self.clips:
            return grads
        clipped, _ = optax.clip_by_global_norm(vector[self.layout.clip_index]).update(
            grads, optax.EmptyState()
        )
        return clipped

    @functools.cached_property
    def base(self) -> np.ndarray:
        """The hyperparameter vector with no schedule (read-only, made once per spec): ``ratio *
        base_lr`` per group, each group's decay, a scheduled rule hyperparameter's default, the
        clip threshold, the EMA decay."""
        out = np.zeros(self.layout.size, np.float32)
        out[self.layout.clip_index] = self.clip_norm
        if self.ema:
            out[self.layout.ema_index] = self.ema_decay
        for i, (group, hyper) in enumerate(self.layout.slots):
            g = next(x for x in self.groups if x.name == group)
            if hyper == "learning_rate":
                out[i] = g.ratio * self.base_lr
            elif hyper == "weight_decay":
                out[i] = g.weight_decay
            else:  # a rule's own hyperparameter (always scheduled): its default until then
                out[i] = rule_hypers(g.rule)[hyper]
        out.setflags(write=False)
        return out

    def with_scheduled(self, scheduled: dict) -> "OptimizerSpec":
        """This spec with ``scheduled[group]`` (rule hyperparameter names, e.g. ``("b1",)``)
        injected as program inputs for those groups, and the vector's layout extended."""
        if not any(scheduled.values()):
            return self
        groups = tuple(
            dataclasses.replace(g, scheduled=tuple(h for h in g.schedulable if h in scheduled.get(g.name, ())))
            for g in self.groups
        )
        layout = HyperLayout(tuple((g.name, h) for g in groups for h in g.hypers), ema=self.layout.ema)
        return dataclasses.replace(self, groups=groups, layout=layout)


def _decoupled(rule: Callable, anchor: str = "zero", scheduled: tuple[str, ...] = ()) -> Callable:
    """The factory ``optax.inject_hyperparams`` wraps: ``rule`` at ``learning_rate`` (and the
    scheduled rule hyperparameters, by name), chained with the decoupled decay. Its signature
    names every injected hyperparameter (inject_hyperparams reads it)."""
    import inspect

    def make(learning_rate, weight_decay, **own):
        inner = rule(learning_rate, **own)
        if anchor == "w0":
            return optax.chain(inner, decay_toward_anchor(-learning_rate * weight_decay))
        return optax.chain(inner, optax.add_decayed_weights(-learning_rate * weight_decay))

    P = inspect.Parameter
    make.__signature__ = inspect.Signature(
        [P(n, P.POSITIONAL_OR_KEYWORD) for n in ("learning_rate", "weight_decay")]
        + [P(n, P.KEYWORD_ONLY) for n in scheduled]
    )
    make.__name__ = getattr(rule, "__name__", "rule")
    return make


def init_opt_state(spec: OptimizerSpec, tx, params, anchor=None):
    """The optimizer state for ``params`` (``tx.init``: the EMA starts at ``params``). ``anchor``: the
    weights ``"w0"`` groups decay toward, when not ``params`` (``build_model``'s after a warm start)."""
    state = tx.init(params)
    if spec.anchored and anchor is not None:
        is_anchor = lambda x: isinstance(x, AnchorState)  # noqa: E731
        from_anchor = tx.init(anchor)
        state = jax.tree_util.tree_map(
            lambda cur, a: a if is_anchor(cur) else cur, state, from_anchor, is_leaf=is_anchor
        )
    return state


def ema_params(decay) -> optax.GradientTransformationExtraArgs:
    """The optax transformation, last in a chain, whose state (:class:`EmaState`, read by
    :func:`ema_of`) keeps an exponential moving average of the params, starting at ``init``'s:
    ``update(updates, state, params, **extra)`` passes ``updates`` through and moves the average
    to ``ema + (1 - decay) * (new - ema)``, ``new = optax.apply_updates(params, updates)`` (no
    bias correction). ``decay``: a number (float32), or a function of the extra arguments
    (jaxnitro's reads the step's ``hypers=`` vector: a new decay compiles nothing)."""

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("jaxnitro: ema_params needs the params: call `tx.update(updates, state, params)`.")
        d = decay(**extra) if callable(decay) else jnp.asarray(decay, jnp.float32)
        return updates, ema_track(state, optax.apply_updates(params, updates), d)

    return optax.GradientTransformationExtraArgs(lambda params: EmaState(_copy(params)), update)


def ema_track(state: EmaState, params, decay) -> EmaState:
    """``ema + (1 - decay) * (params - ema)``: the average moved toward ``params``."""
    return EmaState(
        jax.tree_util.tree_map(lambda e, p: e + ((1 - decay) * (p - e)).astype(e.dtype), state.params_ema, params)
    )


def ema_of(opt_state):
    """The moving average of the params that ``opt_state`` holds (:func:`ema_params` ending its chain), or None."""
    if type(opt_state) is tuple and opt_state:  # a chain's state (not a NamedTuple): the EMA ends it
        opt_state = opt_state[-1]
    return opt_state.params_ema if isinstance(opt_state, EmaState) else None


def rule_state_of(opt_state):
    """The optimizer rules' state (``opt_state`` without the EMA, which ends the chain)."""
    return opt_state[0] if ema_of(opt_state) is not None else opt_state


def with_parts(opt_state, rules, ema=None):
    """An optimizer state laid out as ``opt_state``: the rules' state, and its EMA when it keeps one."""
    return (rules, EmaState(ema)) if ema_of(opt_state) is not None else rules


def _fed(tx, spec: "OptimizerSpec") -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``update`` first writes the step's hyperparameter vector (``hypers=``) into its state."""

    def update(updates, state, params=None, *, hypers, **extra):
        return tx.update(updates, set_hypers(state, spec, hypers), params)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def set_hypers(opt_state, spec: OptimizerSpec, vector):
    """Write the per-step hyperparameter ``vector`` into ``opt_state`` (inside a traced program).

    ``opt_state`` is the state of :meth:`OptimizerSpec.transformation`: one
    group's injected state, or a ``multi_transform`` state holding one per group.
    """
    inner = opt_state

    def with_values(st, group):
        hp = dict(st.hyperparams)
        for i, (g, hyper) in enumerate(spec.layout.slots):
            if g == group:
                hp[hyper] = vector[i]
        return st._replace(hyperparams=hp)

    if len(spec.groups) == 1:
        inner = with_values(inner, spec.groups[0].name)
    else:
        states = dict(inner.inner_states)
        for group, masked in states.items():
            states[group] = masked._replace(inner_state=with_values(masked.inner_state, group))
        inner = inner._replace(inner_states=states)
    return inner


def build_optimizer_spec(e, hooks, params, clip_norm: float, ema_decay: float | None = None) -> OptimizerSpec:
    """Resolve groups, rules, ratios, decays, decay anchors and the base learning rate from the
    experiment's hooks.

    ``hooks`` maps hook names to :class:`~jaxnitro.plugin_manager.ResolvedHook`.
    Raises ``ValueError`` naming the group when a ratio or decay is negative or not finite,
    a rule is not callable or ``decay_anchor`` is not ``"zero"`` / ``"w0"``; ``TypeError`` /
    ``ValueError`` naming the hook when ``learning_rate`` is not a finite number >= 0.
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    group_of = hooks["param_group"].function
    if isinstance(params, dict) and hooks["param_group"].source == "default":
        group_of = lambda _e, keypath: str(keypath[0])  # noqa: E731  (a dict of models: one group each)
    with_leaf = takes_positionals(group_of, "param_group") == 2  # param_group(self, keypath, leaf)
    names = []
    counts: dict[str, int] = {}
    for path, leaf in leaves_with_paths:
        g = group_of(e, keypath_of(path), leaf) if with_leaf else group_of(e, keypath_of(path))
        if not isinstance(g, str):
            raise TypeError(
                f"jaxnitro: `param_group` returned {g!r} for {keypath_of(path)}; it must return a "
                f"group name (str)."
            )
        names.append(g)
        counts[g] = counts.get(g, 0) + int(np.size(leaf))
    labels = jax.tree_util.tree_unflatten(treedef, names)
    groups = tuple(_group_spec(e, hooks, name, n) for name, n in sorted(counts.items()))
    slots = [(g.name, h) for g in groups for h in HYPERS]  # rule hyperparameters join when scheduled (with_scheduled)
    base_lr = check_learning_rate(
        hooks["learning_rate"].function(e),
        f"`learning_rate` of {type(e).__name__} ({hooks['learning_rate'].source})",
    )
    layout = HyperLayout(tuple(slots), ema=ema_decay is not None)
    return OptimizerSpec(groups, labels, float(clip_norm or 0.0), layout, ema_decay, base_lr)


def _group_spec(e, hooks, name: str, n_params: int) -> GroupSpec:
    """Group ``name``'s rule, ratio, decay and decay anchor from the experiment's hooks, checked."""
    rule = hooks["optimizer"].function(e, name)
    if not callable(rule):
        raise TypeError(
            f"jaxnitro: `optimizer` returned {rule!r} for group `{name}`; return an optax rule "
            f"factory such as `optax.radam` (called with `learning_rate`)."
        )
    ratio = float(hooks["learning_rate_ratio"].function(e, name))
    decay = float(hooks["weight_decay"].function(e, name))
    if ratio < 0 or decay < 0:
        raise ValueError(
            f"jaxnitro: group `{name}` has learning_rate_ratio={ratio} and weight_decay={decay}; "
            f"both must be >= 0."
        )
    for hook, v in (("learning_rate_ratio", ratio), ("weight_decay", decay)):
        if not math.isfinite(v):
            raise ValueError(
                f"jaxnitro: `{hook}({name!r})` of {type(e).__name__} returned {v!r}; it must be a "
                f"finite number >= 0 (NaN would make the group's weights NaN, reported later "
                f"as a divergence). Return a number for group `{name}`."
            )
    anchor = hooks["decay_anchor"].function(e, name) if "decay_anchor" in hooks else "zero"
    if not isinstance(anchor, str) or anchor not in ANCHORS:
        raise ValueError(
            f"jaxnitro: `decay_anchor` returned {anchor!r} for group `{name}`; it must return "
            f"'zero' (decay toward zero, the default) or 'w0' (L2-SP: toward the group's initial "
            f"weights, or the transferred ones with `weights=..., w0='weights'`)."
        )
    return GroupSpec(name, rule, ratio, decay, n_params, anchor)


def check_learning_rate(value, source: str) -> float:
    """The base learning rate as a float; ``ValueError`` unless it is a finite number >= 0.

    ``source`` says where it came from (``"the learning_rate hook of Tiny (experiment)"``).
    """
    arr = None if isinstance(value, (str, bytes, bool, np.bool_)) else np.asarray(value)
    rate = float(value) if arr is not None and arr.shape == () and arr.dtype.kind in "iuf" else None
    said = f"jaxnitro: the base learning rate is {value if rate is None else rate!r} ({source}); it must be"
    if rate is None:
        raise TypeError(
            f"{said} a number, e.g. `def learning_rate(self): return 1e-3`. Return a schedule "
            f"through `schedules={{'learning_rate': ...}}`, not from `learning_rate`."
        )
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(
            f"{said} a finite number >= 0. A negative rate ascends the loss, NaN or inf makes every "
            f"weight NaN (reported later as a divergence). Return a positive rate such as 1e-3."
        )
    return rate
