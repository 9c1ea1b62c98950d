"""C sources of the CPU kernels (package data), built at first use by kernels/quant_cpu.py."""
