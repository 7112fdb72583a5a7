"""The hook contracts of jaxnitro, as pluggy hookspecs.

Two families live here.

**Experiment hooks** are plain methods on an experiment class (no decorator).
The experiment instance is the first plugin of its handle's plugin manager;
installed plugins come next and built-in defaults last. The core resolves each
hook once, when a :class:`jaxnitro.Nitro` is built, and calls the chosen
implementation itself, because batch fields are routed to hooks as
keyword-only arguments: ``def forward(self, model, state, *, img)`` receives
the batch's ``img`` and nothing else. The ``batch`` parameter of a spec below
stands for those keyword-only fields; pluggy ignores keyword-only parameters
when it validates an implementation.

Positional parameters are passed by position, so an implementation may name
them freely (``def loss(self, logits, *, label)``); their count must match
the spec. Every implementation, also one from a plugin, is called with the
experiment as its first argument (``self``): the real experiment in host-side
hooks, its compile view (Device values traced, Host fields stripped) in
traced hooks (``forward``, ``loss``, ``train_metrics``, device-resident
``metrics``).

**Extension hooks** are global. They are implemented by modules registered as
entry points in group ``jaxnitro`` (``[project.entry-points.jaxnitro]``), the
built-in logger and progress reporter included, exactly as a third-party
package registers its own. Their names start with ``jaxnitro_``.
"""

from __future__ import annotations

import pluggy

PROJECT = "jaxnitro"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class ExperimentSpec:
    """Experiment hooks. Implement them as methods of an ``@jn.experiment`` class."""

    # -- data and model ---------------------------------------------------

    @hookspec(firstresult=True)
    def build_data(self, dist):
        """Return the splits: ``{"train": source, "val": source, "test": ...}``.

        Runs on the host against the real experiment (Host fields readable).
        A source is an iterable of dicts of host (NumPy) arrays with ``len()``;
        the batch dimension is first. ``train`` must drop its partial final
        batch and its batch count must divide by ``accum``. ``dist`` is
        reserved for a distribution handle and is ``None`` in one process.
        Skipped when ``Nitro(e, data=...)`` is given.
        """

    @hookspec(firstresult=True)
    def derive(self, data):
        """Return ``{field: host value}`` computed from the data.

        Runs after ``build_data`` and before Device fields are converted; the
        result is merged into the experiment with ``attrs.evolve``. An unknown
        field name raises.
        """

    @hookspec(firstresult=True)
    def build_model(self, key):
        """Return an Equinox model, or ``(model, state)`` from ``eqx.nn.make_with_state``.

        ``key`` is a ``jax.random`` key derived from the run's ``seed``.
        """

    # -- traced hooks -----------------------------------------------------

    @hookspec(firstresult=True)
    def forward(self, model, state, batch):
        """Return ``(outputs, state)``. Batch fields arrive as keyword-only arguments.

        ``state`` is the ``eqx.nn.State`` (``None`` for a stateless model); the
        core strips the returned state before ``loss``/``metrics``. During
        evaluation and prediction ``model`` is in inference mode.
        """

    @hookspec(firstresult=True)
    def loss(self, outputs, batch):
        """Return the scalar loss of one batch (traced, differentiated)."""

    @hookspec(firstresult=True)
    def metrics(self, outputs, batch):
        """Return ``{name: (value, mode)}`` for one evaluation batch.

        ``mode`` is a number (a count: values and counts are summed over the
        split and divided once), ``"sum"``, ``"max"``, ``"min"`` or
        ``"concat"``. Never sees padding rows. Default: ``{"loss": (loss, 1)}``.
        """

    @hookspec(firstresult=True)
    def train_metrics(self, outputs, batch):
        """Return ``{name: scalar}``: per-step diagnostics traced in the gradient program."""

    @hookspec(firstresult=True)
    def finalize_metrics(self, acc, split):
        """Host-side: turn the reduced split metrics ``acc`` into what is reported.

        Counted keys arrive divided, ``"sum"`` keys as raw totals. The return
        value replaces ``acc`` for the logger, early stopping and history.
        """

    @hookspec(firstresult=True)
    def metrics_residency(self, hook):
        """Return ``"device"`` or ``"host"`` for ``hook`` (``"metrics"`` or ``"train_metrics"``).

        Defaults: ``"device"`` for ``train_metrics``, ``"host"`` for ``metrics``.
        """

    # -- optimizer --------------------------------------------------------

    @hookspec(firstresult=True)
    def param_group(self, keypath):
        """Return the group name of the parameter at ``keypath`` (a tuple of str/int)."""

    @hookspec(firstresult=True)
    def learning_rate(self):
        """Return the base learning rate (default ``1e-3``)."""

    @hookspec(firstresult=True)
    def learning_rate_ratio(self, group):
        """Return ``group``'s rate as a ratio of the base rate (default ``1.0``)."""

    @hookspec(firstresult=True)
    def weight_decay(self, group):
        """Return ``group``'s decoupled weight decay (default ``0.0``)."""

    @hookspec(firstresult=True)
    def optimizer(self, group):
        """Return an optax rule factory taking ``learning_rate`` (default ``optax.radam``)."""

    @hookspec(firstresult=True)
    def monitor(self):
        """Return ``(metric, "max" | "min")``: the metric the run is judged by."""


class ExtensionSpec:
    """Extension hooks, implemented by entry-point plugins (group ``jaxnitro``)."""

    @hookspec(firstresult=True)
    def jaxnitro_make_logger(self, name, run_dir, experiment):
        """Return a logger for ``name`` (e.g. ``"jsonl"``), or ``None`` if not yours.

        ``run_dir`` is the run's own folder (a ``pathlib.Path``, created).
        A logger is any object with the verbs the framework calls:
        ``log_params(params)``, ``log_other(key, value)``,
        ``log_metrics(metrics, *, step, epoch, context)``, ``finish(status)``
        and optionally ``info()``.
        """

    @hookspec(firstresult=True)
    def jaxnitro_adapt_source(self, source, split):
        """Return a jaxnitro source wrapping a foreign loader, or ``None`` if not yours."""

    @hookspec(firstresult=True)
    def jaxnitro_make_progress_reporter(self, name):
        """Return a progress reporter for ``name`` (``"auto"`` = the default), or ``None``.

        A reporter has ``begin(total, label)``, ``update(position, label)``
        (``position`` in epochs, fractional) and ``close(label)``.
        """


EXPERIMENT_HOOKS = tuple(
    n for n in vars(ExperimentSpec) if not n.startswith("_")
)
"""Names of the experiment hooks, in contract order."""
