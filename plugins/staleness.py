"""The stale-handle report: what was redefined since a handle was built.

Entry point ``staleness``, on the ``jaxnitro_before_verb`` lifecycle hook.
A handle keeps what it resolved at construction (its experiment hooks and
each run knob's value and accessor). When, afterwards, a hook is redefined (a
monkeypatched method, or the experiment class redefined by re-running a
notebook cell) or a scalar run-knob accessor answers differently, every verb
prints to stderr what changed and how to rebuild. Silent when nothing
changed; ``jn.set_config_report(False)`` (exported by this plugin) silences it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from jaxnitro.plugin import EXPERIMENT_HOOKS, SCALAR_KNOBS, call_method, hookimpl, is_experiment, method_of

__all__ = ["Snapshot", "set_config_report"]

_enabled = True


def set_config_report(enabled: bool) -> bool:
    """Turn the stale-handle report on or off for the process; return the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def _same_code(a, b) -> bool:
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return a is b
    return ca.co_code == cb.co_code and ca.co_consts == cb.co_consts and ca.co_names == cb.co_names


@dataclass
class Snapshot:
    """What a handle resolved at construction that can be redefined later."""

    cls: type
    hooks: dict  # hook name -> function (experiment-defined hooks), None when absent
    knobs: dict  # knob name -> (accessor function, value at construction)

    @classmethod
    def of(cls, nitro) -> "Snapshot":
        """What ``nitro`` resolved at construction, read from its own record."""
        hooks = {
            h: (nitro.plan.hooks[h].function if h in nitro.plan.hooks and nitro.plan.hooks[h].source == "experiment" else None)
            for h in EXPERIMENT_HOOKS
        }
        knobs = {
            name: (r.accessor, r.value)
            for name, r in nitro.settings.knobs.items()
            if r.source == "accessor" and name in SCALAR_KNOBS
        }
        return cls(type(nitro.experiment), hooks, knobs)

    def changes(self, nitro) -> list[str]:
        """Lines describing what changed since construction (empty when nothing did)."""
        e = nitro.experiment
        lines = []
        current_cls = self.cls
        module = sys.modules.get(self.cls.__module__)
        newer = getattr(module, self.cls.__qualname__, None) if module is not None else None
        redefined_class = newer is not None and newer is not self.cls and is_experiment(newer)
        if redefined_class:
            current_cls = newer
        for name, (accessor, value) in self.knobs.items():
            method = method_of(current_cls, name)  # a method wins over a field, as knobs resolve
            if method is None:
                continue
            now_fn = getattr(method, "__func__", method)
            if now_fn is accessor or getattr(accessor, "__func__", None) is now_fn or _same_code(now_fn, accessor):
                continue
            try:
                now = call_method(e, method)
            except Exception as err:  # an accessor that no longer runs is a change too
                now = f"<raises {type(err).__name__}>"
            if now != value:
                lines.append(
                    f"! `{name}` returned {value!r} at construction and returns {now!r} now. This "
                    f"handle still uses {value!r}; rebuild to pick up {now!r}."
                )
        changed = []
        for hook, fn in self.hooks.items():
            now = getattr(current_cls, hook, None)
            if fn is None and now is None:
                continue
            if fn is None or now is None:
                changed.append(f"{hook} ({'added' if fn is None else 'removed'})")
            elif now is not fn and not (redefined_class and _same_code(now, fn)):
                changed.append(hook)
        if changed:
            lines.append(
                f"! hooks were redefined after this Nitro was built: {', '.join(changed)}. It keeps "
                f"running the programs it was built with; rebuild the Nitro to pick up the new "
                f"code. The compile cache is module-level, so a rebuild recompiles only what changed."
            )
        if redefined_class and not lines:
            return []
        return lines

    def report(self, nitro, verb: str) -> None:
        """Print the changes (if any) to stderr, naming the verb that noticed them."""
        lines = self.changes(nitro)
        if not lines:
            return
        name = self.cls.__name__
        head = (
            f"jaxnitro: {name} has values fixed at construction that have since been redefined "
            f"(reported by `{verb}`). This handle keeps what it resolved; build a new Nitro "
            f"(`jn.Nitro(e, data=n.data, ...)`) to pick up the new ones, and see `print(nitro)` "
            f"for what it holds."
        )
        print("\n  ".join([head] + lines), file=sys.stderr)


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"set_config_report": set_config_report}


@hookimpl(trylast=True)
def jaxnitro_before_verb(nitro, verb):
    if _enabled:
        Snapshot.of(nitro).report(nitro, verb)
