"""Trace mode's table of torch operations."""
