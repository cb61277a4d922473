"""Test support that is not part of the runner: the float64 reference
forward pass, the oracle the GPU and emulator paths are checked against."""
