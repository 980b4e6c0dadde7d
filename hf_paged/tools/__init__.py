"""Developer tools shipped with the package: ``kernel_check`` (``python -m hf_paged check-kernels``) builds every
Triton kernel variant for real GPUs on a machine without one."""
