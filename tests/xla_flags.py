"""XLA_FLAGS of the test processes (pytest's own, set in conftest, and the subprocesses the tests start).

`--xla_backend_optimization_level=1`: LLVM optimizes XLA:CPU's generated kernels at level 1 instead of
3. Every HLO pass (fusion, layout, scheduling) is the same, so the tests check the programs users run;
only machine-code optimization is lighter. The suite mostly compiles (CI starts with an empty
compilation cache) and runs few steps: on the 2-core machine the demo model's step compiled in 15.5 s
instead of 21.6 and ran as fast (0.22 s vs 0.24; bench/step.py's realistic shape 3.37–3.40 s vs 3.42),
and six compile-heavy test files took 372 s instead of 497 cold (2026-11-26). Level 0 compiles faster
still but doubles the step time. Results differ from level 3 in rounding (LLVM contracts multiply-adds
into FMAs differently), so runs compared bit for bit must all use these flags — every test process does.
"""
LLVM_LEVEL = "--xla_backend_optimization_level=1"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {LLVM_LEVEL}"
