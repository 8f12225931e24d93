"""Training (`python -m jaxsora.train`), grouped by concern: `run/` (the run and its supervision),
`step/` (the jitted step, its state, the optimizer), `eval/` (the validation loss), `plan/` (config
checks, the memory plan, the dry run, FLOPs). `build` and `contracts` are the components a run is
built from and the protocols it is written against."""
