"""helexa.kernels."""
