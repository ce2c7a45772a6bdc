"""A script run as the ranks of a test (forked, with torchrun's environment): fsdp_trainer.train, except that rank
$FULL_DISK_RANK finds the disk full (ENOSPC on opening any checkpoint file to write) while the file $FULL_DISK_FLAG
exists: a full disk on one rank, for machines where a test cannot mount a small file system of its own."""

import errno
import os
from contextlib import contextmanager

import fsdp_trainer.checkpoint.storage as storage
import fsdp_trainer.train as train


class FullOnOneRank(storage.NamingFileSystem):
    @contextmanager
    def create_stream(self, path, mode):
        if (
            "w" in mode
            and os.environ["RANK"] == os.environ["FULL_DISK_RANK"]
            and os.path.exists(os.environ["FULL_DISK_FLAG"])
        ):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        with super().create_stream(path, mode) as stream:
            yield stream


storage.NamingFileSystem = FullOnOneRank
train.main()
