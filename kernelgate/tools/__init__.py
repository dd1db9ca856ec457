"""Tooling, not the runtime: benchmark timing, parity-check helpers, and the compile checks
(every Triton kernel built for GPUs this machine does not have)."""
