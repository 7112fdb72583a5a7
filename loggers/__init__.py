"""Built-in loggers (each registered as an entry point in group ``jaxnitro``; see docs/loggers.md).

* ``jsonl``: ``metrics.jsonl`` in the run folder, the default logger (``"jsonl"``, ``"json"``).
* ``console``: one readable line per epoch and per validation, through structlog
  (``"console"``; ``jaxnitro.ConsoleLogger``).
* ``tensorboard``: TensorBoard event files in the run folder (``"tensorboard"``, ``"tb"``;
  ``jaxnitro.TensorBoardLogger``); needs the extra ``jaxnitro[tensorboard]``.
* ``mlflow``: an MLflow run, by default in ``sqlite:///<run folder>/mlflow.db``
  (``"mlflow"``; ``jaxnitro.MLflowLogger``); needs the extra ``jaxnitro[mlflow]``.

The modules import their optional packages only when a logger starts, so every plugin
loads without them. No module here imports another.
"""
