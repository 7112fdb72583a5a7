"""Export the trained inference program with ``jax.export``; load it without the experiment.

The built-in exporter (entry point ``export``): it answers ``jaxnitro_export`` (``trylast``,
so an installed exporter replaces it), which ``nitro.export(path, ...)`` asks with the
handle's :class:`~jaxnitro.plugin.InferenceProgram`, and exports ``jn.load_exported``,
``jn.ExportedForward`` and ``jn.ExportError``. ``nitro.export(path)`` writes a folder:

* ``forward.jaxexport``: the serialized :class:`jax.export.Exported` of the handle's
  ``forward`` in inference mode (the same trace as ``nitro.predict``: the experiment's
  compile view with its GraphConst values, ``eqx.nn.inference_mode``, the eval weights),
  the batch dimension symbolic when the model allows it;
* ``metadata.json``: input fields (shapes with ``"batch"`` for the symbolic dimension,
  dtypes), the compiled width, output structure, how Device values and weights are held,
  the experiment class and GraphConst values, the jax / jaxnitro versions, and what is not
  part of the program (``metrics``, ``loss``, host hooks).

The weights (``nitro.state.eval_params``: the EMA when on; and ``nitro.model_state``)
are baked into the program as constants. Device values are baked too by default, or
become named inputs with ``device_inputs=True`` (their exported values are the defaults).
Every baked constant passes through ``jax.lax.optimization_barrier`` first, so XLA
compiles the operations that read it as it compiles ``predict``'s program, which takes
them as inputs: without the barrier XLA folds the constant weights into a convolution
and rounds it differently (measured ~1e-7 on a small conv net).

The destination is checked before anything is traced: a path that is a file, a folder
that already holds an export (unless ``overwrite=True``) or a location that cannot be
written is an :class:`ExportError` naming the path and the fix. Each file is written
under a temporary name and renamed into place.

``jn.load_exported(path)`` returns an :class:`ExportedForward`: call it with the batch
fields as keywords (``f(x=...)``) to get host NumPy outputs equal to ``nitro.predict`` on
the same batch (bitwise, on the same backend: a batch narrower than the compiled width is
padded to it and sliced back, exactly as ``predict`` does). It needs only jax and NumPy's
view of the artifact: the experiment's module is never imported. A missing, truncated or
corrupted file of the artifact is an :class:`ExportError` naming the file and saying to
export again; a Device value passed to an export that baked it in is refused.

Modules: :mod:`.artifact` (file names, :class:`ExportError`, the destination check),
:mod:`.write` (:func:`export_program`), :mod:`.load` (:func:`load_exported`).
"""

from __future__ import annotations

from jaxnitro.plugin import hookimpl

from .artifact import METADATA_FILE, PROGRAM_FILE, ExportError
from .load import ExportedForward, load_exported
from .write import export_program

__all__ = ["export_program", "load_exported", "ExportedForward", "ExportError", "PROGRAM_FILE", "METADATA_FILE"]


@hookimpl(trylast=True)
def jaxnitro_export(program, path, options):
    """The built-in exporter: ``jax.export`` and ``metadata.json`` (:func:`export_program`)."""
    return export_program(program, path, **options)


@hookimpl
def jaxnitro_exports():
    return {"load_exported": load_exported, "ExportedForward": ExportedForward, "ExportError": ExportError}
