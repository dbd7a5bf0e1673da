"""What fits: the memory model per strategy (``model``, ``param_counts``, ``table``), the choice
``strategy="auto"`` makes from it (``strategy_choice``) and the memory a device offers
(``device_memory``): torch-free, the JAX backend sizes from them too; and on torch
``micro_batch_size="auto"``: the probe (``micro_batch_probe``), its batch from a DataLoader
(``probe_batch``), the optimizers' states it holds (``shadow_optimizers``), how the ranks stop
together and agree (``micro_batch_agreement``), the cached answer (``micro_batch_cache``), the
peak a probe measures (``peak_memory``), and the out-of-memory split (``oom_split``).

May import: ``accumix.errors``, ``accumix.common``; the torch modules also torch,
``accumix.runtime``, ``accumix.data``, ``accumix.checkpoint.rng_state`` and ``accumix.step``
(the run state); never ``accumix.accelerator``.
"""
