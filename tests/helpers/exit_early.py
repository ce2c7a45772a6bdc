"""A script run as the ranks of a test (forked, with torchrun's environment): fsdp_trainer.train, except that rank
$EXIT_RANK leaves with status 0 when it reaches step $EXIT_STEP, as a rank that returns early by mistake would. Its
peers must fail naming it, not hang."""

import os

import fsdp_trainer.train as train

_train_step = train.train_step
_calls = 0


def _train_step_that_exits(*args, **kwargs):
    global _calls
    _calls += 1
    if _calls == int(os.environ["EXIT_STEP"]) and os.environ["RANK"] == os.environ["EXIT_RANK"]:
        os._exit(0)
    return _train_step(*args, **kwargs)


train.train_step = _train_step_that_exits
train.main()
