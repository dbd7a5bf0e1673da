"""Backend-free and torch-free pieces both backends share: K from the batch sizes
(``batch_sizes``), who am I in the job (``launch_env``), the run directory's layout
(``run_dir``), the datasheet peak FLOP/s (``hardware``) and the micro-batch search
(``micro_batch_search``).

May import: the standard library, numpy and ``accumix.errors`` only (never torch or jax): the
JAX backend imports these without paying for torch.
"""
