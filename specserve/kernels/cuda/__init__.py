"""The CUDA C kernels (package data: common.cuh, gemv_q.cu, gemv_mma.cu) and the Python around them.

build: fills a kernel's placeholders, compiles each variant once with NVRTC, launches it (programmatic
dependent launch, thread-block clusters). driver: the ctypes binding of the CUDA driver calls torch
does not expose. block_shapes: the block shapes and shared-memory layout each product launches with.
"""
