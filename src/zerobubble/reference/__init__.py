"""Single-process ground truths: what a pipelined step must reproduce bitwise.

:func:`~zerobubble.reference.compose.reference_step` (``zerobubble.reference_step``) is the
one entry, the job's dimensions as options; ``step``, ``tp`` and ``ep`` hold the
single-dimension references it composes.
"""
