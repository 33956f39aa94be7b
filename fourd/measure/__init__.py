"""Measuring this machine: timing helpers, peak FLOP/s and memory, and `fourd calibrate`."""
