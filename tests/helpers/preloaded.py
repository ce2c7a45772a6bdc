"""What the forkserver of tests/helpers/forked.py imports once, for every run forked from it: torch, the trainer and
its tools' modules, and transformers (which the tools import to verify an export)."""

import torch  # noqa: F401
import transformers  # noqa: F401

import fsdp_trainer.convert  # noqa: F401
import fsdp_trainer.train  # noqa: F401
