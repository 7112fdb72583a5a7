"""Early stopping: ``jn.EarlyStopping`` and the plugin that applies the ``early_stop`` knob.

Entry point ``early_stopping``. It exports :class:`EarlyStopping` as
``jaxnitro.EarlyStopping``, accepts the ``early_stop`` run knob at setup
(refusing it without a ``monitor`` hook or a ``val`` split), and at every
validated epoch's end asks the policy whether to stop; when it says so the
run ends after that epoch with status ``"done"`` and ``nitro.stop_reason``
saying why.

A policy is any object with ``should_stop(epoch, value, mode) -> bool``
(optionally ``reset()``, called at run start, and ``patience`` for the
message). A resumed run replays the monitored values its checkpoint recorded
(``validated``) through ``should_stop`` first, so it stops where the
uninterrupted run would have. This plugin acts only on a value it accepted itself: a policy
another plugin took charge of (its ``jaxnitro_accept_knob`` answered first)
is that plugin's to apply. Host-side: nothing here is part of a compiled
program.
"""

from __future__ import annotations

import math
import numbers
import warnings

import attrs

from jaxnitro.plugin import hookimpl, improves, monitored_value, owns_knob, require_monitor_and_val

__all__ = ["EarlyStopping"]

@attrs.define
class EarlyStopping:
    """Stop when the monitored metric has not improved for ``patience`` validations (validated
    epochs, or the validations every ``val_every_n_steps`` steps).

    An improvement is a value better than the best so far by more than
    ``min_delta`` in the monitor's direction (``"max"`` or ``"min"``), by
    :func:`jaxnitro.history.improves`, the rule the history and the
    checkpointer share: NaN never improves, nor does a tie (``best_epoch`` is
    then the earliest of the tied epochs, the history's best epoch). Redefining ``should_stop`` on a subclass takes effect at
    the next epoch without compiling anything.
    """

    patience: int = 5
    min_delta: float = 0.0
    best: float | None = attrs.field(default=None, init=False)
    best_epoch: int | None = attrs.field(default=None, init=False)
    bad_epochs: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self):
        p, d = self.patience, self.min_delta
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
            raise ValueError(
                f"jaxnitro: EarlyStopping(patience={p!r}): patience is a whole number of validations "
                f"(epochs, or validations every val_every_n_steps) >= 1 (e.g. patience=5)."
            )
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not math.isfinite(d) or d < 0:
            raise ValueError(
                f"jaxnitro: EarlyStopping(min_delta={d!r}): min_delta is the least change that counts "
                f"as an improvement, a finite number >= 0 in the metric's units; a negative value "
                f"would count a worse epoch as an improvement. The direction comes from `monitor` "
                f"('max' or 'min'), not from the sign of min_delta."
            )

    def reset(self) -> None:
        """Forget the record (a new run starts)."""
        self.best, self.best_epoch, self.bad_epochs = None, None, 0

    def should_stop(self, epoch: int, value: float, mode: str) -> bool:
        """Record ``value`` for ``epoch``; return True when the run should stop now."""
        value = float(value)
        if improves(value, self.best, mode, self.min_delta):  # the history's rule: a tie never improves
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
            return False
        self.bad_epochs += 1
        return self.bad_epochs >= self.patience


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"EarlyStopping": EarlyStopping}


@hookimpl(trylast=True)
def jaxnitro_accept_knob(name, value, nitro):
    """Take the ``early_stop`` knob: a policy with ``should_stop``, a ``monitor`` and a ``val`` split."""
    if name != "early_stop":
        return None
    source = nitro.settings.source("early_stop")
    if not callable(getattr(value, "should_stop", None)):
        raise TypeError(
            f"jaxnitro: `early_stop` = {value!r} ({source}); give a jn.EarlyStopping(patience=...) "
            f"or an object with `should_stop(epoch, value, mode) -> bool`, or None."
        )
    require_monitor_and_val(nitro.settings, nitro.data, type(nitro.experiment).__name__, "early_stop",
                            "stops on the monitored metric", "drop early_stop")
    return True


def _own_policy(run):
    """The run's ``early_stop`` policy if this plugin accepted it (the core records which plugin
    did: :func:`jaxnitro.plugin.owns_knob`), else None."""
    policy = run.settings.early_stop
    return policy if policy is not None and owns_knob(run, "early_stop", __name__) else None


@hookimpl(trylast=True)
def jaxnitro_run_start(run):
    policy = _own_policy(run)
    if policy is None:
        return
    if callable(getattr(policy, "reset", None)):
        policy.reset()
    if run.nitro.plan.resumed is not None:
        _replay(run, policy)


def _replay(run, policy) -> None:
    """A resumed run: give the policy the monitored values of the validations before the resume
    point (the checkpoint's record, ``validated``), so it counts as the uninterrupted run did.
    When they already stop the run (it had stopped early there), the run stops before its first
    step, with a warning that says how to train it longer. A record without them (another
    checkpointer's) is warned about: the count then starts again at the resume point."""
    name, mode = run.monitor
    plan = run.nitro.plan
    record = (plan.weights_meta or {}).get("validated")
    if not record or record.get("name") != name:
        warnings.warn(
            f"jaxnitro: the checkpoint this run resumed from ({plan.resumed.path}) does not record "
            f"{name!r} at the validations before it, so early stopping counts from the resume point "
            f"(its patience starts again) instead of where the interrupted run was.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    for epoch, value, *step in record["values"]:  # [epoch, value, step] ([epoch, value] in older records)
        if policy.should_stop(epoch, float(value), mode):
            where, count = _where(run, epoch, step[0] if step else None), _counted(run, policy)
            run.request_stop(f"early stopping: {name} did not improve for {count} "
                             f"(at {where}, before the resume point)")
            warnings.warn(
                f"jaxnitro: the run resumed from {plan.resumed.path} had already stopped early at "
                f"{where} ({name} did not improve for {count}): nothing is left to "
                f"train. To train it longer, resume with early_stop=None or a larger patience.",
                RuntimeWarning,
                stacklevel=2,
            )
            return


def _counted(run, policy) -> str:
    """What the policy's ``patience`` counted: ``"5 epochs"``, or ``"5 validations (one every
    1,000 steps)"`` when rows follow ``val_every_n_steps``."""
    patience, every = getattr(policy, "patience", "?"), run.settings.val_every_n_steps
    return f"{patience} validations (one every {every:,} steps)" if every else f"{patience} epochs"


def _where(run, epoch: int, step: int | None) -> str:
    """Where a validation was: ``"epoch 4"``, or ``"step 3,000"`` when rows follow
    ``val_every_n_steps`` (and the step is known)."""
    return f"step {step:,}" if run.settings.val_every_n_steps and step is not None else f"epoch {epoch}"


@hookimpl(trylast=True)
def jaxnitro_epoch_end(run, row):
    """Ask the policy about a validated epoch; request the stop when it says so."""
    policy = _own_policy(run)
    got = monitored_value(run, row) if policy is not None else None
    if got is None:
        return
    name, mode, value = got
    nan, where = math.isnan(float(value)), _where(run, row["epoch"], row["step"])
    if nan:
        warnings.warn(
            f"jaxnitro: the monitored metric {name!r} is NaN at {where}; early stopping "
            f"counts it as no improvement. A NaN metric usually means a count of 0, a log(0), or "
            f"weights that became NaN.",
            RuntimeWarning,
            stacklevel=2,
        )
    if policy.should_stop(row["epoch"], value, mode):
        count = _counted(run, policy)
        why = (
            f"{name} was NaN at {where} (NaN never counts as an improvement), so it did "
            f"not improve for {count}" if nan else f"{name} did not improve for {count}"
        )
        run.request_stop(f"early stopping: {why}")
