"""Kernels of the CUDA device written for helexa (Triton), each beside its plain-torch reference."""
