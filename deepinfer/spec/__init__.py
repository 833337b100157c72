"""Speculative decoding: weight-free draft sources, online confidence calibration, the
hardware-aware verify scheduler (DSpark's Algorithm 1) and exact verification."""
