"""A training run and its supervision: `loop.train` (start-up, refusals, the run folder's claim),
`steps` (the step loop: dispatch, log, evaluate, save), `setup` (mesh, encoders, state plan, jitted
step), `folder` (numbered run folders, `--run-dir`, `--load`), `supervise` (watchdog, stop requests,
heartbeats, the run lock, stack dumps), `logging` (console line and wandb)."""
