"""Recipe that builds batchgen's bundled demo chat model from the Python stdlib."""
