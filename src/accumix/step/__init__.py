"""The loop's bookkeeping around the user's code, in the canonical order (DESIGN.md "The step"):
``acc.setup`` (``object_setup``, ``compile``), K from the batch sizes and its changes
(``accum_steps``), the window (``accumulation``), one micro-step and its backward
(``micro_step``), each optimizer's boundary: finalize, agree on overflow, clip, step or skip
(``boundary``), the window's end: one loss-scale update and the deferred ``zero_grad``
(``window_end``), the optimizer and scheduler wrappers (``optim``), and the ranks' agreement
at the start and the end (``lifecycle``); the façade's read-only properties over the run state
(``run_view``).

May import: torch, ``accumix.errors``, ``accumix.common``, ``accumix.precision``,
``accumix.strategies``, ``accumix.runtime``, ``accumix.data``; never ``accumix.accelerator``.
"""
