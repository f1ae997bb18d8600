"""Measurements of the real train step: jaxtron's benchmark rows and a peer framework's step on
the same work."""
