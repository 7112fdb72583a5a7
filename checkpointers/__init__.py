"""Checkpointer plugins (entry points in group ``jaxnitro``).

Empty in this version: orbax-based checkpointing, resume and ``weights=`` from a
checkpoint are not available yet (``checkpointer=`` raises ``NotImplementedError``).
"""
