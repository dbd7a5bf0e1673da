"""The process a run lives in: the launch environment made real (device, process group, seeding:
``env``), faults (a dead or hung rank named, the others stopped, pre-emption: ``fault``) and
accumix's logger (``logging_setup``).

May import: torch, ``accumix.errors`` and ``accumix.common``; never the step, memory,
checkpoint or trainer packages (they build on this one).
"""
