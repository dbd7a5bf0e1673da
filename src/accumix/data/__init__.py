"""What feeds the loop: the DataLoader wrapper (distributed sampler, epochs, device placement,
resumable position, the look-ahead that finds an epoch's last batch: ``loader``) and per-sample
random streams (augmentation that depends on seed, epoch and index only: ``sample_seeds``).

May import: torch, ``accumix.errors`` and ``accumix.common``. The JAX backend reuses the
loader for torch DataLoaders.
"""
