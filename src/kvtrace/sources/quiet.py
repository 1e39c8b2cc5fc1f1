"""Keeping the libraries that load models quiet in a terminal: what they print is addressed to library
authors, not to someone waiting for an answer. Used by the CLI (unless ``--debug``) and by the tiered start's
background build; importing this module imports nothing heavy."""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["QUIET_LOGGERS", "quiet_libraries"]

# torchao (pulled in by transformers when installed, e.g. with the executorch extra) logs each CUDA-only
# kernel library it cannot load on a CPU machine, and torch's pytree a deprecation of how torchao registers
# its enums: four lines on every command that loads a model.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_libraries() -> None:
    """transformers' and huggingface_hub's progress bars off (kvtrace shows its own progress), deprecation
    warnings ignored, ``QUIET_LOGGERS`` below ERROR. An environment variable the user set wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
