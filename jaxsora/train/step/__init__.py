"""The train step and what it updates: `train_step` (the jitted step and its batch layout), `state`
(the train state, its sharding plan and creation on the mesh), `optim` (AdamW, the LR schedule, EMA)."""
