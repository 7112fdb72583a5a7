"""Built-in jaxnitro plugins (each registered as an entry point in group ``jaxnitro``).

* ``progress``: the tqdm progress reporter (``jaxnitro_make_progress_reporter``).
"""
