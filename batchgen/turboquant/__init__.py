"""TurboQuant's maths in pure MLX: the codec and the reading rule (the reference every
faster form is tested against). No caches and no kernels here."""
