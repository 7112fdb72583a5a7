"""Built-in loggers (each registered as an entry point in group ``jaxnitro``).

* ``jsonl``: ``metrics.jsonl`` in the run folder, the default logger.
"""
