"""The validation loss on a held-out table: `loss` (the `Evaluator` the run calls), `data` (which rows
each eval bucket reads, in which batches), `step` (the jitted eval function)."""
