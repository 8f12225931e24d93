"""What a run is checked against before it starts: `validate` (the config; `ranges`: every numeric
knob's range), `memory` (every bucket's compiled step against the device), `dry_run` (`--dry-run`:
both, printed), `mfu` (model FLOPs and the device's peak)."""
