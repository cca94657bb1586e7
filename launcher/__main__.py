import atexit
import os
import sys

from launcher import forkserver

# Flags that only print (help, the composed config, completion) launch nothing.
_PRINT_ONLY = ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "--shell-completion", "-sc")


def _launches_by_forkserver(argv: list[str]) -> bool:
    return not any(a in _PRINT_ONLY or a.split("=")[0] in _PRINT_ONLY for a in argv) and not any(
        a.startswith("start_method=") and a != "start_method=forkserver" for a in argv)


def _exit_now(code) -> None:
    """Exit without the interpreter's teardown (torch's module and library destructors take a
    third of a second): every rank has exited and the report and result.json are written.
    The exit handlers still run (a few ms): logging's flushes the logs, multiprocessing's
    removes the forkserver's socket folder, which would otherwise stay behind in the temp dir."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs first; stdlib, but without a public name
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":  # not when a spawned worker re-imports the main module
    if _launches_by_forkserver(sys.argv[1:]):
        forkserver.start()  # its torch import overlaps the launcher's own imports below
    from launcher.cli import main

    try:
        main()
    except SystemExit as e:
        _exit_now(e.code)
