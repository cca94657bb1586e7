import atexit
import os
import sys

# The status _skip_teardown exits with: an error (2) unless main ends with a status of its own.
_exit_status = [2]


def _skip_teardown() -> None:
    """The last exit handler (registered before anything else): end the process without the
    interpreter's module teardown and torch's library destructors (a third of a second). By
    now a normal exit ran every other step in order: other libraries' threads and worker
    processes were shut down, every other exit handler ran (logging's flush,
    multiprocessing's removal of the forkserver's socket folder). Where joblib's loky ran jobs
    here (`hydra/launcher=joblib`), the teardown stays: it releases loky's semaphores, which
    loky's resource tracker would otherwise report as leaked."""
    if "joblib.externals.loky" in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[0])


# Flags that only print (help, the composed config, completion) launch nothing.
_PRINT_ONLY = ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "--shell-completion", "-sc")


def _launches_by_forkserver(argv: list[str]) -> bool:
    return not any(a in _PRINT_ONLY or a.split("=")[0] in _PRINT_ONLY for a in argv) and not any(
        a.startswith("start_method=") and a != "start_method=forkserver" for a in argv)


def _status(code) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def run() -> None:
    """`python -m launcher` and the `dsv4-tp-harness` console script."""
    atexit.register(_skip_teardown)  # first registered (before multiprocessing's), last run
    from launcher.run import import_gc  # the collector paused until the imports below are done
    from launcher.run import forkserver

    if _launches_by_forkserver(sys.argv[1:]):
        forkserver.start()  # its torch import overlaps the launcher's own imports below
    from launcher.cli import main

    import_gc.resume()

    try:
        main()
    except SystemExit as e:
        _exit_status[0] = _status(e.code)
        raise SystemExit(_exit_status[0]) from None


if __name__ == "__main__":  # not when a spawned worker re-imports the main module
    run()
