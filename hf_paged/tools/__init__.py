"""Tools beside the runtime: simulation and plots, the kernel build check (not used by a forward)."""
