"""Ops used by the transformer: a torch reference per op, a Triton version where it pays on CUDA.

Each module exposes the op under one name; callers never choose the implementation.
"""
