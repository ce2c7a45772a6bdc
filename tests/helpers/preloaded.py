"""What the forkserver of tests/helpers/forked.py imports once, for every run forked from it: torch, the trainer and
its tools' modules, transformers (which the tools import to verify an export), and what a run imports on its way
(about 1 s of CPU a forked rank otherwise spends on each)."""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (a model built on the meta device reaches it: torch._refs' ops disable dynamo)
import transformers  # noqa: F401

import fsdp_trainer.convert  # noqa: F401
import fsdp_trainer.train  # noqa: F401
from fsdp_trainer.config.parse import recipe_parser

recipe_parser()  # imports jsonargparse and the modules it loads on its first parser

try:  # every run writes TensorBoard events where the package is installed (the test extras install it)
    import torch.utils.tensorboard  # noqa: F401
except ImportError:
    pass

import gc  # noqa: E402

# What is loaded so far lives as long as the server and every fork: kept out of each run's garbage collections (a run's
# gc.collect() otherwise walks it all, 0.2 s at a run's end) and out of the pages a collection would copy.
gc.freeze()
