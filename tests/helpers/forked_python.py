"""A stand-in for `python` where a program the tests run starts the interpreter it is given (torchrun's PYTHON_EXEC,
tools/slurm/train.sbatch's PYTHON; tests/helpers/python runs this file): `forked_python.py [-u] -m MODULE ARGS` or
`forked_python.py [-u] SCRIPT ARGS` runs as `python` would run it, but in a process forked from the tests' forkserver
(forked.py), which has imported torch and the package (2-2.6 s of CPU that a worker or launcher started as a new
interpreter spends before it reads its recipe). The run writes to this process's stdout and stderr, the same open
files (their offsets shared with the program's other writers); a signal this process gets goes to the run; this
process exits as the run did (by the same signal, if a signal ended it). The forkserver is the one at forked.SHARED
in the environment (forked.stand_in_env())."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import forked  # noqa: E402  (imports no torch)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    args, env = sys.argv[1:], dict(os.environ)
    if args[0] == "-u":  # as torchrun starts its workers: unbuffered output (forked._run reads it)
        args, env["PYTHONUNBUFFERED"] = args[1:], "1"
    run = forked.start(*forked.python_target(args), [(1, 2)], env=env, cwd=Path.cwd())
    for sig in FORWARDED:
        signal.signal(sig, lambda received, _: run.send_signal(received))
    code = run.wait()
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
