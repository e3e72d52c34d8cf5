"""Measurement harness: greedy references, admission control, bench, windows."""
