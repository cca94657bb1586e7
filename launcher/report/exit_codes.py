"""The exit status of a run: every compared tensor passed, a mismatch, anything else (an
invalid config, a crashed or hung rank, an implementation that broke the contract).

Apart from `launcher.report.result` (which imports torch) so that the command line's front
door (help, --cfg, refusals) can exit with them without importing it."""

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
