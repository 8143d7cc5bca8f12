"""Gradient synchronisation strategies across data-parallel replicas."""
