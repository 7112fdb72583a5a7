"""Weights that enter a handle from elsewhere: checkpoint records, warm starts, resume; EMA.

``Nitro(e, weights=..., resume=..., w0=..., restore_optimizer=..., restore_best=...)``:

* ``weights=`` another ``Nitro`` is a warm start (``setup._warm_start``); any other
  value names checkpoints, which a plugin finds through the ``jaxnitro_load_weights``
  extension hook (the ``orbax`` checkpointer answers it) and describes with a
  :class:`WeightsRecord`. The core checks the record against the experiment (class,
  GraphConst values, the parameter tree) before a single array is read, then asks
  the record to restore exactly what the handle needs: params and model state
  for ``weights=``, also the optimizer state and the EMA for ``resume=``. A handle
  without a train split never allocates optimizer state.
* Values a record carries as JSON (``derive``'s results, GraphConst values) go through
  :func:`jsonable` / :func:`from_jsonable`, shared by the core and the plugins.

The core never imports a checkpointer: a record is all they share.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import attrs
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EMA",
    "WeightsRecord",
    "NoCheckpointError",
    "jsonable",
    "from_jsonable",
    "tree_listing",
    "tree_diff",
    "abstract",
    "incompatibility",
]


# -- EMA ---------------------------------------------------------------------------------


def _check_decay(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0.0 < float(value) < 1.0:
        raise ValueError(
            f"jaxnitro: EMA(decay={value!r}); the decay must be a number strictly between 0 and 1 "
            f"(0.999 averages over about the last 1000 steps)."
        )


@attrs.frozen
class EMA:
    """``ema=jn.EMA(decay=0.999)``: keep an exponential moving average of the parameters.

    After each optimizer step, inside the train-step program (no extra dispatch):
    ``ema = ema + (1 - decay) * (params - ema)``, starting from the initial params.
    Validation, evaluation, prediction, the monitored metric and ``nitro.model`` use
    the average; checkpoints hold it and ``resume`` restores it. The decay is an
    input of the program: another decay compiles nothing.
    """

    decay: float = attrs.field(default=0.999, validator=_check_decay, converter=float)


def check_ema_knob(value, source: str):
    """The ``ema`` knob: None or an object with a ``decay`` in (0, 1); returns the decay or None."""
    if value is None:
        return None
    decay = getattr(value, "decay", None)
    if decay is None or isinstance(decay, bool) or not isinstance(decay, (int, float, np.floating)) or not 0 < decay < 1:
        raise ValueError(
            f"jaxnitro: run knob `ema` = {value!r} ({source}); give jn.EMA(decay=0.999) (a decay "
            f"strictly between 0 and 1), or None for no moving average."
        )
    return float(decay)


# -- records ---------------------------------------------------------------------------------


class NoCheckpointError(FileNotFoundError):
    """Raised by a ``jaxnitro_load_weights`` implementation when nothing matches the spec."""


@dataclass(frozen=True)
class WeightsRecord:
    """One checkpoint (or an average of several) as the core sees it, before any array is read.

    - ``source``: where the weights come from, in words (``print(nitro)`` shows it);
    - ``path``: the checkpoint folder (the newest one, for an average);
    - ``run_folder``: the run folder it belongs to, or None;
    - ``newest_in_run``: whether its run has no later checkpoint a run could continue from
      (a resume then continues that run's folder; otherwise it branches into a new one);
    - ``items``: the saved trees: ``"params"``, and any of ``"model_state"``,
      ``"opt_state"`` (the optimizer rules' state, without the EMA), ``"ema"``;
    - ``metadata``: the decoded JSON record: ``experiment`` (``module``, ``qualname``),
      ``graph_const`` and ``derived`` (:func:`jsonable` values), ``tree`` (``{"params":
      tree_listing}``), ``step``, ``epoch``, ``epoch_complete``, ``steps_per_epoch``,
      ``rng`` (``{"data": [...], "dtype": ...}``), ``metrics``, ``seed``, ``end``;
    - ``restore``: ``restore({item: abstract tree}) -> {item: tree}`` reads the named
      items into those structures (:func:`abstract`); an average averages ``params``
      and ``ema`` and takes the rest from its newest checkpoint;
    - ``notes``: what the reader found that differs from what the spec asked, in words (an
      average of fewer checkpoints than asked; newer runs passed over as another
      experiment's): the core warns each one (``RuntimeWarning``), so nothing is silent.
    """

    source: str
    path: str
    run_folder: str | None
    metadata: Mapping
    items: tuple[str, ...]
    restore: Callable[[Mapping], dict]
    newest_in_run: bool = True
    notes: tuple[str, ...] = ()


# -- JSON-able values ---------------------------------------------------------------------


def jsonable(value, *, strict: bool = True):
    """``value`` as JSON-able data that :func:`from_jsonable` turns back.

    None, bools, numbers, strings, lists, tuples, dicts with string keys, NumPy and JAX
    arrays and scalars. Anything else raises ``TypeError`` (``strict``) or becomes
    ``{"__unrecorded__": type name, "repr": ...}``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, np.generic):
        return jsonable(value.item(), strict=strict)
    if isinstance(value, (np.ndarray, jax.Array)):
        arr = np.asarray(value)
        if arr.dtype.kind in "biuf":
            return {"__array__": arr.tolist(), "dtype": str(arr.dtype), "shape": list(arr.shape)}
    elif isinstance(value, tuple):
        return {"__tuple__": [jsonable(v, strict=strict) for v in value]}
    elif isinstance(value, list):
        return [jsonable(v, strict=strict) for v in value]
    elif isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: jsonable(v, strict=strict) for k, v in value.items()}
    if strict:
        raise TypeError(f"{type(value).__name__} is not recordable as JSON")
    return {"__unrecorded__": type(value).__name__, "repr": repr(value)[:200]}


def from_jsonable(data):
    """The value :func:`jsonable` recorded (an unrecorded value comes back as its marker dict)."""
    if isinstance(data, list):
        return [from_jsonable(v) for v in data]
    if isinstance(data, dict):
        if "__array__" in data:
            arr = np.asarray(data["__array__"], dtype=data["dtype"])
            return arr.reshape(data["shape"])
        if "__tuple__" in data:
            return tuple(from_jsonable(v) for v in data["__tuple__"])
        if "__float__" in data:
            return float(data["__float__"])
        if "__unrecorded__" in data:
            return data
        return {k: from_jsonable(v) for k, v in data.items()}
    return data


def _canonical(value) -> str:
    return json.dumps(jsonable(value, strict=False), sort_keys=True)


# -- trees ------------------------------------------------------------------------------------


def tree_listing(tree) -> dict[str, list]:
    """``{keystr(path): [shape, dtype]}`` for each array leaf of ``tree``."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[jax.tree_util.keystr(path)] = [list(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))]
    return out


def tree_diff(ours: Mapping, theirs: Mapping) -> list[str]:
    """Lines naming each leaf whose shape differs (or that one side lacks), from two
    :func:`tree_listing` results (dtypes are not compared: a restore casts)."""

    def shape(listing, name):
        entry = listing.get(name)
        return "missing" if entry is None else tuple(entry[0])

    return [
        f"{name}: this model {shape(ours, name)}, weights {shape(theirs, name)}"
        for name in sorted(set(ours) | set(theirs))
        if shape(ours, name) != shape(theirs, name)
    ]


def tree_diff_error(diff: list[str], fix: str, graph_note: str = "", keyword: str = "weights") -> ValueError:
    """The refusal of weights whose tree differs from the model's: the diff, then ``fix``
    (``keyword``: the handle keyword that named them, ``weights`` or ``resume``)."""
    return ValueError(
        f"jaxnitro: `{keyword}=` names weights of a model with a different tree; leaves that differ:\n  "
        + "\n  ".join(diff)
        + graph_note
        + "\n"
        + fix
    )


def abstract(tree):
    """``tree`` with every array leaf replaced by its ``jax.ShapeDtypeStruct`` (what restores fill).

    A leaf already placed on a mesh (``NamedSharding``: sharded parameters and their optimizer
    state, placed before the restore) keeps its sharding, so orbax reads each device's shard
    straight onto it, whatever the device count the checkpoint was written with."""
    def spec(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    return jax.tree_util.tree_map(spec, tree)


# -- the keywords -------------------------------------------------------------------------------


def is_handle(value) -> bool:
    """A ``Nitro`` (duck-typed: the core's handle module imports this one)."""
    from .state import TrainState

    return isinstance(getattr(value, "state", None), TrainState) and hasattr(value, "experiment")


def check_keywords(kwargs: dict) -> None:
    """Refuse contradictory or meaningless combinations of the weight keywords."""
    weights, resume = kwargs.get("weights"), kwargs.get("resume", False)
    w0 = kwargs.get("w0")
    if weights is not None and resume not in (None, False):
        raise ValueError(
            f"jaxnitro: `weights={_short(weights)}` and `resume={resume!r}` were both given; they are "
            f"two answers to where the parameters come from. `resume` continues a run (its optimizer "
            f"state, step count and run folder); `weights` starts a new run from those weights. "
            f"Pass one of them."
        )
    if w0 not in (None, "build_model", "weights"):
        raise ValueError(
            f"jaxnitro: `w0={w0!r}`; it must be 'build_model' (the default: `decay_anchor = 'w0'` "
            f"groups decay toward build_model's initial weights) or 'weights' (toward the weights "
            f"given with `weights=`)."
        )
    if w0 == "weights" and weights is None:
        raise ValueError(
            "jaxnitro: `w0='weights'` anchors L2-SP decay to the transferred weights, but no "
            "`weights=` was given. Pass `weights=` (a checkpoint, ('latest', 'best'), another Nitro), "
            "or drop `w0`."
        )
    restore_best = kwargs.get("restore_best", False)
    restore_optimizer = kwargs.get("restore_optimizer", True)
    for name, value in (("restore_best", restore_best), ("restore_optimizer", restore_optimizer)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"jaxnitro: `{name}={value!r}`; it must be True or False.")
    if resume in (None, False):
        for name, value, default in (("restore_best", restore_best, False), ("restore_optimizer", restore_optimizer, True)):
            if bool(value) != default:
                raise ValueError(
                    f"jaxnitro: `{name}={value!r}` refines `resume`, but no `resume=` was given, so it "
                    f"would be silently ignored. Pass `resume='auto'` (or a checkpoint path) with it, "
                    f"or drop it."
                )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def find_record(e, kwargs: dict, run_dir: str, monitor):
    """The :class:`WeightsRecord` that ``weights=`` or ``resume=`` names (None: neither,
    a warm start from another handle, or ``resume="auto"`` finding nothing, with a warning).

    Raises, naming the plugin, when no loaded plugin reads the spec.
    """
    from .plugin_manager import disabled_note, first_result

    weights, resume = kwargs.get("weights"), kwargs.get("resume", False)
    if weights is not None:
        if is_handle(weights):
            return None
        spec, purpose, keyword = weights, "weights", "weights"
    elif resume not in (None, False):
        if resume is True or resume == "auto":
            spec = ("latest", "best") if kwargs.get("restore_best") else "auto"
        else:
            spec = resume
            if kwargs.get("restore_best"):
                raise ValueError(
                    f"jaxnitro: `restore_best=True` picks the best checkpoint of the run `resume` finds, "
                    f"but `resume={_short(resume)}` already names one checkpoint. Use `resume='auto', "
                    f"restore_best=True`, or name the checkpoint you want."
                )
        purpose, keyword = "resume", "resume"
    else:
        return None
    try:
        record = first_result(
            "jaxnitro_load_weights", spec=spec, run_dir=run_dir, experiment=e, monitor=monitor, purpose=purpose
        )
    except NoCheckpointError as err:
        if purpose == "resume" and (resume is True or resume == "auto"):
            warnings.warn(
                f"jaxnitro: resume='auto' found no checkpoint to continue ({getattr(err, 'what', err)}); "
                f"starting a fresh run.",  # `what`: the reader's finding, without its advice on naming one
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        raise
    if record is None:
        raise ValueError(
            f"jaxnitro: `{keyword}={_short(spec)}` names checkpoints, but no loaded plugin reads "
            f"checkpoints (the `jaxnitro_load_weights` hook; the built-in `orbax` checkpointer plugin "
            f"answers it){disabled_note()}. Install or enable that plugin, or warm-start from a "
            f"handle with `weights=<another Nitro>`."
        )
    if not isinstance(record, WeightsRecord):
        raise TypeError(
            f"jaxnitro: a plugin answered `jaxnitro_load_weights` with {type(record).__name__}; it "
            f"must return a jaxnitro.weights.WeightsRecord."
        )
    check_class(e, record, keyword)
    for note in record.notes:
        warnings.warn(note if note.startswith("jaxnitro:") else f"jaxnitro: {note}", RuntimeWarning, stacklevel=4)
    return record


def _class_names(e, metadata: Mapping) -> tuple[str, str, str] | None:
    """``(ours, theirs, their qualname)`` when ``metadata`` was saved by another experiment class
    (compared by ``__qualname__``), else None."""
    saved = metadata.get("experiment", {})
    cls = type(e)
    # by qualified name: a script's class is `__main__.X` when it saves and `script.X` when a
    # notebook imports it; the tree and GraphConst checks still apply
    if cls.__qualname__ == saved.get("qualname"):
        return None
    ours = f"{cls.__module__}.{cls.__qualname__}"
    theirs = f"{saved.get('module', '?')}.{saved.get('qualname', '?')}"
    return ours, theirs, saved.get("qualname", "?")


def _graph_diff(e, metadata: Mapping) -> tuple[list[str], list[str]]:
    """``(names, lines)`` of the GraphConst values that differ between ``e`` and ``metadata``."""
    from .experiment import fields_of

    graph = {n: getattr(e, n) for n, i in fields_of(e).items() if i.is_graph_const}
    saved_graph = metadata.get("graph_const") or {}
    differing = [
        n
        for n in sorted(set(graph) | set(saved_graph))
        if n not in graph or n not in saved_graph or _canonical(graph[n]) != json.dumps(saved_graph[n], sort_keys=True)
    ]
    lines = [
        f"{n}: this experiment {graph.get(n, 'missing')!r}, checkpoint "
        f"{from_jsonable(saved_graph[n]) if n in saved_graph else 'missing'!r}"
        for n in differing
    ]
    return differing, lines


def incompatibility(e, metadata: Mapping) -> str | None:
    """Why a checkpoint whose record is ``metadata`` cannot hold experiment ``e``'s weights, in
    words (saved by another experiment class; other GraphConst values), or None.

    What ``resume="auto"`` uses to pass over the runs of other experiments (a checkpoint
    reader calls it on each candidate run's newest checkpoint, newest run first).
    """
    names = _class_names(e, metadata)
    if names is not None:
        return f"saved by experiment class `{names[1]}`, not `{names[0]}`"
    _, lines = _graph_diff(e, metadata)
    if lines:
        return "other GraphConst values: " + "; ".join(lines)
    return None


def check_class(e, record: WeightsRecord, keyword: str = "weights") -> None:
    """Refuse a record saved by another experiment class (compared by ``__qualname__``);
    ``keyword`` (``weights`` or ``resume``) names the handle keyword in the message."""
    names = _class_names(e, record.metadata)
    if names is None:
        return
    ours, theirs, qualname = names
    if keyword == "resume":
        fix = (
            f"A run continues with its own experiment: build the handle with a `{qualname}` "
            f"instance to continue that run, or name a run of `{ours}` in `resume=` "
            f"(`resume='auto'` finds the newest one), or start fresh without `resume=`."
        )
    else:
        fix = (
            f"Build the handle with a `{qualname}` instance, or, to start this experiment from "
            f"those weights, load them with that class and warm-start from its handle "
            f"(`weights=<that Nitro>`)."
        )
    raise ValueError(
        f"jaxnitro: `{keyword}=`: the checkpoint {record.path} was saved by experiment class `{theirs}`, not "
        f"`{ours}`; its weights, derived values and GraphConst values belong to that experiment. {fix}"
    )


def derived_values(e, record: WeightsRecord) -> dict:
    """The derived values a record carries, decoded, as ``{field: value}`` for ``attrs.evolve``."""
    from .experiment import fields_of

    saved = from_jsonable(record.metadata.get("derived") or {})
    fields = fields_of(e)
    unknown = [n for n in saved if n not in fields]
    if unknown:
        raise ValueError(
            f"jaxnitro: the checkpoint {record.path} carries derived values for {unknown}, which are "
            f"not fields of {type(e).__name__}; it was saved by another version of the class."
        )
    lost = [n for n, v in saved.items() if isinstance(v, dict) and "__unrecorded__" in v]
    if lost:
        warnings.warn(
            f"jaxnitro: the checkpoint {record.path} could not record the derived values {lost} "
            f"(not JSON-able); they keep the experiment's own values, since `derive` is skipped.",
            RuntimeWarning,
            stacklevel=4,
        )
    return {n: v for n, v in saved.items() if n not in lost}


def check_tree_and_graph(e, params, record: WeightsRecord, keyword: str = "weights") -> None:
    """Refuse a record whose parameter tree or GraphConst values differ from this experiment's
    (``keyword``, ``weights`` or ``resume``, names the handle keyword in the message)."""
    differing, graph_diff = _graph_diff(e, record.metadata)
    theirs = (record.metadata.get("tree") or {}).get("params") or {}
    diff = tree_diff(tree_listing(params), theirs)
    if diff:
        note = ("\nGraphConst values that differ: " + "; ".join(graph_diff)) if graph_diff else ""
        raise tree_diff_error(
            diff,
            f"The checkpoint is {record.path}. Build the experiment with the GraphConst values it was "
            f"trained with, or train this one without `{keyword}=`.",
            note,
            keyword,
        )
    if graph_diff:
        raise ValueError(
            f"jaxnitro: `{keyword}=`: the checkpoint {record.path} was saved with other GraphConst values "
            "(structural: they define the compiled graph): " + "; ".join(graph_diff) + ". Build the "
            "experiment with the checkpoint's values (" + ", ".join(f"{n}=..." for n in differing) + "), "
            f"or start without `{keyword}=`."
        )


def restore_items(record: WeightsRecord, wanted: dict) -> dict:
    """``record.restore(wanted)`` (the items of ``wanted`` it holds), turning a read failure into
    an error naming the checkpoint."""
    try:
        got = record.restore(wanted)
        return {k: got[k] for k in wanted if k in got}
    except (ValueError, TypeError) as err:
        if str(err).startswith("jaxnitro:"):
            raise
        raise ValueError(
            f"jaxnitro: could not read {sorted(wanted)} from the checkpoint {record.path}: {err}"
        ) from err


def install_weights(state, record: WeightsRecord):
    """``weights=<record>``: its params (its EMA when it kept one) and model state; step 0,
    fresh optimizer (built later). Returns ``(state, where the weights came from, in words)``."""
    item = "ema" if "ema" in record.items else "params"
    wanted = {item: abstract(state.params)}
    if state.model_state is not None and "model_state" in record.items:
        wanted["model_state"] = abstract(state.model_state)
    got = restore_items(record, wanted)
    params = jax.tree_util.tree_map(jnp.asarray, got[item])
    model_state = got.get("model_state", state.model_state)
    weights_from = record.source + (" (its EMA weights)" if item == "ema" else "")
    return state.replace(params=params, model_state=model_state), weights_from


def _optimizer_mismatch(record: WeightsRecord, rest: dict, err: ValueError) -> ValueError:
    """The refusal when a resume could not read the optimizer state: when everything else reads
    (``rest``), the checkpoint is healthy and the optimizer's structure changed; say so."""
    try:
        restore_items(record, rest)
    except ValueError:  # the rest fails too: the checkpoint itself is damaged
        return ValueError(
            f"{err}\nIf the optimizer changed since the checkpoint was saved (rules, groups, "
            f"`decay_anchor`), resume with `restore_optimizer=False` for a fresh optimizer state."
        )
    cause = str(err.__cause__ or err)
    return ValueError(
        f"jaxnitro: `resume=`: the optimizer state saved in {record.path} has another structure "
        f"than this handle's optimizer: the optimizer changed since the checkpoint was saved (its "
        f"rules, parameter groups, `decay_anchor` or `ema`). The checkpoint itself is readable "
        f"(its {', '.join(sorted(rest))} restore). Resume with `restore_optimizer=False` to continue "
        f"from its parameters, step and epoch with a fresh optimizer state, or build the handle "
        f"with the optimizer the run was trained with. (orbax: {cause[:300]})"
    )


def _check_resumable(record: WeightsRecord, steps_per_epoch, accum, width, has_ema: bool, restores: bool) -> None:
    """``ValueError`` when ``record`` cannot be resumed by this handle: other steps per epoch,
    ``accum`` or train batch ``width`` (the data position counts batches), or, when its optimizer
    state is restored (``restores``), an EMA in one of them only (``has_ema``: the handle's)."""
    meta = record.metadata
    for what, key, now in (("optimizer steps per epoch (the train split and `accum`)", "steps_per_epoch", steps_per_epoch),
                           ("accum", "accum", accum), ("a train batch size", "batch_width", width)):
        if meta.get(key) is not None and now is not None and meta[key] != now:
            raise ValueError(
                f"jaxnitro: the checkpoint {record.path} was saved by a run with {what} of {meta[key]}; "
                f"this handle has {now}. Its data position counts the batches read, so a resumed run "
                f"must read the same batches in the same order; resume with {what} of {meta[key]}, or "
                f"use `weights=` to start a new run from these weights instead."
            )
    if restores and has_ema != ("ema" in record.items):
        raise ValueError(
            f"jaxnitro: `resume=`: the checkpoint {record.path} was saved "
            f"{'without' if has_ema else 'with'} an EMA of the parameters and this handle has "
            f"{'one' if has_ema else 'none'}: `ema` changed since (the average would silently "
            f"restart, or be dropped). Resume with the `ema` the run was trained with, or with "
            f"`restore_optimizer=False` for a fresh optimizer state (and EMA)."
        )


def install_resume(state, record: WeightsRecord, *, restore_optimizer: bool, steps_per_epoch, accum=None,
                   width=None):
    """``resume=``: params, model state, EMA, optimizer state (``restore_optimizer``), step,
    epoch and PRNG key from the record; the optimizer state must already be built
    (its structure is the restore target). Any checkpoint is a resume point, at an epoch's end or in its middle: the
    loop continues from its step (the data position follows from it: the epoch and the next
    batch of a source with ``len()``). ``ValueError`` when the record's steps per epoch,
    ``accum`` or train batch ``width`` differ from the handle's (a stream has no steps per
    epoch: its position counts batches). Returns ``(state, the ResumePoint, where the weights
    came from, in words)``."""
    from .optim import ema_of, rule_state_of, with_parts
    from .state import ResumePoint

    meta = record.metadata
    rules, ema = rule_state_of(state.opt_state), ema_of(state.opt_state)
    _check_resumable(record, steps_per_epoch, accum, width, ema is not None, restore_optimizer and "opt_state" in record.items)
    wanted = {"params": abstract(state.params)}
    if state.model_state is not None and "model_state" in record.items:
        wanted["model_state"] = abstract(state.model_state)
    if rules is not None and restore_optimizer and "opt_state" in record.items:
        wanted["opt_state"] = abstract(rules)
    if ema is not None and "ema" in record.items:
        wanted["ema"] = abstract(state.params)
    try:
        got = restore_items(record, wanted)
    except ValueError as err:
        if "opt_state" not in wanted:
            raise
        raise _optimizer_mismatch(record, {k: v for k, v in wanted.items() if k != "opt_state"}, err) from err
    params = jax.tree_util.tree_map(jnp.asarray, got["params"])
    opt_state = state.opt_state
    if opt_state is not None:  # a checkpoint without an EMA: the average restarts at its params
        fresh = None if ema is None or "ema" in got else jax.tree_util.tree_map(lambda p: jnp.copy(p), params)
        opt_state = with_parts(opt_state, got.get("opt_state", rules), got.get("ema", fresh))
    rng = state.rng
    if meta.get("rng"):
        rng = jnp.asarray(np.asarray(meta["rng"]["data"], dtype=meta["rng"]["dtype"]))
    step, epoch = int(meta["step"]), int(meta["epoch"])
    open_row = (meta.get("progress") or {}).get("open_row")
    position = dict(meta.get("data_position") or {}, epoch_complete=bool(meta.get("epoch_complete")))
    resumed = ResumePoint(record.path, record.run_folder, step, epoch, bool(record.newest_in_run), open_row, position)
    optimizer = "" if "opt_state" in got or opt_state is None else ", fresh optimizer state"
    weights_from = f"resumed from {record.source}{optimizer}"
    return state.replace(
        params=params,
        model_state=got.get("model_state", state.model_state),
        opt_state=opt_state,
        step=step,
        epoch=epoch,
        rng=rng,
    ), resumed, weights_from
