"""shardspeed: DeepSpeed's API on plain PyTorch. `import shardspeed as deepspeed` and keep your script.

The package imports torch only when something that needs it is first used, so that the `shardspeed`
launcher starts torchrun without paying for a torch import of its own.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from tqdm import tqdm

# shardspeed's own version. Under the deepspeed alias (shardspeed.compat) `__version__` reports the
# DeepSpeed version shardspeed follows, since libraries compare it with DeepSpeed's releases.
shardspeed_version = "0.1.0"
__version__ = shardspeed_version
__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "PipelineEngine",
    "PipelineModule",
    "ShardSpeedConfig",
    "ShardSpeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "shardspeed_version",
    "tp_model_init",
]


class _RankZeroOnly(logging.Filter):
    """Every rank validates the same config; say things once (errors still come from every rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "shardspeed_any_rank", False):  # utils.log_dist chose the ranks
            return True
        return record.levelno >= logging.ERROR or _rank() == 0


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _ProgressBarSafeHandler(logging.StreamHandler):
    """Writes through tqdm, so log lines land above a running progress bar instead of inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _setup_logging() -> None:
    logger = logging.getLogger("shardspeed")
    if logger.handlers:
        return
    handler = _ProgressBarSafeHandler()
    handler.setFormatter(logging.Formatter("[shardspeed] %(levelname)s %(message)s"))
    handler.addFilter(_RankZeroOnly())
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("SHARDSPEED_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


_setup_logging()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags: --deepspeed, --deepspeed_config (and the deprecated --deepscale*)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable shardspeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


# Public names that live in rooms importing torch: loaded on first use (PEP 562).
_LAZY = {
    "initialize": "shardspeed.runtime.api",
    "tp_model_init": "shardspeed.runtime.api",
    "init_inference": "shardspeed.inference.engine",
    "InferenceEngine": "shardspeed.inference.engine",
    "ShardSpeedEngine": "shardspeed.runtime.engine",
    "DeepSpeedEngine": "shardspeed.runtime.engine",
    "PipelineEngine": "shardspeed.pipe",
    "PipelineModule": "shardspeed.pipe",
    "init_distributed": "shardspeed.comm",
    "ConfigError": "shardspeed.config",
    "ShardSpeedConfig": "shardspeed.config",
    "get_accelerator": "shardspeed.accelerator",
    "OnDevice": "shardspeed.utils.init_on_device",
    "log_dist": "shardspeed.utils",
    "logger": "shardspeed.utils",
}
_SUBMODULES = (
    "accelerator",
    "checkpoint",
    "checkpointing",
    "comm",
    "compat",
    "config",
    "inference",
    "launcher",
    "moe",
    "ops",
    "optim",
    "pipe",
    "precision",
    "runtime",
    "testing",
    "utils",
    "zero",
)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'shardspeed' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
