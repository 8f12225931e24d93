"""The run config's checks, under the name users and tools import (`from jaxsora.config import
validate_config, ConfigError`). They live with the training code that owns what they check:
`jaxsora/train/plan/validate.py` and `ranges.py`; the error class is `jaxsora.errors.ConfigError`."""
from jaxsora.errors import ConfigError
from jaxsora.train.plan.ranges import RANGES, check_ranges
from jaxsora.train.plan.validate import load_bucket_config_file, need_table, validate_config

__all__ = ["ConfigError", "RANGES", "check_ranges", "load_bucket_config_file", "need_table", "validate_config"]
