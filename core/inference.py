"""What ``nitro.export`` hands an exporter plugin: the handle's inference program as narrow values.

The core does not export: ``nitro.export(path, ...)`` builds one frozen
:class:`InferenceProgram` and asks the ``jaxnitro_export`` hook (``firstresult``) to
write it; the built-in answer is the ``export`` plugin (``jaxnitro.plugins.export``:
``jax.export``, ``jn.load_exported``). :func:`export_program` is that verb's body,
including the error when no loaded plugin answers; the handle's verb records the answer as
the handle's (``print(nitro)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .batches import batch_width, field_specs
from .evaluation import FieldReference, checked_width, key_entries
from .plugin_manager import disabled_note, first_result
from .programs import with_key

__all__ = ["InferenceProgram", "inference_program", "export_program"]


@dataclass(frozen=True)
class InferenceProgram:
    """A handle's ``forward`` in inference mode, as ``nitro.predict`` runs it, and what describes it.

    * ``experiment_class``: the experiment's class (its ``__module__`` / ``__qualname__``
      name the artifact's source; it need not be importable where the artifact is loaded);
    * ``fields`` / ``required``: the batch fields ``forward`` declares, and those it requires;
    * ``params`` / ``model_state``: the weights predict uses (``nitro.state.eval_params``: the
      EMA when on; ``nitro.model_state``, or None), as the handle holds them (device arrays);
    * ``weights_source``: ``"ema"`` or ``"params"``;
    * ``device_values``: ``{name: value}``, the handle's Device values;
    * ``key_entries``: the key entries predict adds to a batch when ``forward`` takes ``key``
      (the run's base key, counter 0), else None;
    * ``graph_values``: the experiment's GraphConst values (trace-time constants).

    :meth:`apply` is the traceable body of the forward program, :meth:`signature` the input
    signature (read lazily: on a handle without data it records a reference batch, as the
    first ``predict`` does, so an exporter checks its destination first).
    """

    experiment_class: type
    fields: tuple[str, ...]
    required: tuple[str, ...]
    params: Any
    model_state: Any
    weights_source: str
    device_values: Mapping[str, Any]
    key_entries: Mapping[str, Any] | None
    graph_values: Mapping[str, Any]
    _apply: Callable[..., Any] = field(repr=False)
    _signature: Callable[[Mapping | None], tuple[dict, int] | None] = field(repr=False)

    def apply(self, params, model_state, dev: Mapping, batch: Mapping):
        """``outputs`` of ``forward`` on ``batch`` (``{field: array}``, plus :attr:`key_entries`
        when ``forward`` takes ``key``), traceable: the compile view with ``dev`` as the Device
        values, ``eqx.nn.inference_mode``, the precision policy; the returned state dropped."""
        return self._apply(params, model_state, dev, batch)

    def signature(self, example: Mapping | None = None) -> tuple[dict, int] | None:
        """``({field: (trailing shape, dtype)}, width)`` of ``forward``'s batch fields, or None
        when the handle knows no input signature (no data it reads cheaply, nothing predicted,
        no ``example``).

        ``example`` (one batch dict) is checked as ``predict`` checks a batch (``TypeError``,
        ``ValueError`` naming the field) and, on a handle with no reference yet, becomes it and
        fixes the compiled width. Fields without a batch dimension in the reference are left out.
        """
        return self._signature(example)


def _signature_of(plan, reference: FieldReference, keep_plan: Callable[[Any], None]):
    """``InferenceProgram.signature`` over ``plan`` and the handle's prediction ``reference``:
    an ``example`` is checked as predict checks a batch; a plan that gains its compiled width
    from it is handed to ``keep_plan`` (the handle keeps it, as after its first predict)."""

    def signature(example):
        nonlocal plan
        route = plan.routes["forward"]
        if example is not None:
            if not isinstance(example, Mapping):
                raise TypeError(
                    f"jaxnitro: `export(example=...)` takes one batch dict with the fields `forward` "
                    f"declares ({list(route.fields)}), got {type(example).__name__}."
                )
            route.check(example.keys(), "the `example` batch")
            host = {f: np.asarray(example[f]) for f in route.fields if f in example}
            reference.check(host)  # the same checks predict makes (records it on a bare handle)
            plan = checked_width(plan, batch_width(host, "the `example` batch"), "the `example` batch")
            keep_plan(plan)
            specs = field_specs(host)
        else:
            ref = reference.specs()
            if ref is None or plan.width is None:
                return None
            specs = ref[0]
        return {f: specs[f] for f in route.fields if f in specs}, plan.width

    return signature


def _apply_of(progs) -> Callable[..., Any]:
    def apply(params, model_state, dev, batch):  # the body of ProgramSet.forward, inference mode
        outputs, _ = progs._forward(progs.view(dev), params, model_state, with_key(batch), inference=True)
        return outputs

    return apply


def inference_program(experiment_class: type, plan, state, device_values: Mapping, reference: FieldReference,
                      keep_plan: Callable[[Any], None]) -> InferenceProgram:
    """The :class:`InferenceProgram` of a handle's ``plan``, its ``state`` (the eval weights, the
    model state, the run key) and ``device_values`` (see :func:`_signature_of` for ``reference``
    and ``keep_plan``)."""
    route = plan.routes["forward"]
    return InferenceProgram(
        experiment_class=experiment_class,
        fields=tuple(route.fields),
        required=tuple(route.required),
        params=state.eval_params,
        model_state=state.model_state,
        weights_source="ema" if state.ema is not None else "params",
        device_values=dict(device_values),
        key_entries=key_entries(state.rng) if route.wants_key else None,
        graph_values=dict(plan.programs.graph_values),
        _apply=_apply_of(plan.programs),
        _signature=_signature_of(plan, reference, keep_plan),
    )


def export_program(program: InferenceProgram, path, options: dict[str, Any]):
    """``nitro.export(path, **options)``'s body: the first ``jaxnitro_export`` answer for
    ``program``; ``RuntimeError`` naming the ``export`` plugin when none answers."""
    written = first_result("jaxnitro_export", program=program, path=path, options=options)
    if written is None:
        raise RuntimeError(
            "jaxnitro: `nitro.export` found no plugin that exports: the built-in plugin `export` "
            "(entry point `export` in group `jaxnitro`, module jaxnitro.plugins.export) writes "
            f"exports, and it is not loaded{disabled_note()}. Fix: re-enable it (drop `export` from "
            "JAXNITRO_DISABLE_PLUGINS) or reinstall jaxnitro, or install a plugin implementing "
            "`jaxnitro_export`."
        )
    return written
