"""The CLI's exit codes (contract): 0 success, 1 does not fit / a check failed, 2 invalid arguments or input,
141 the reader closed the output early (`plan | head`), quietly. `submit` has its own (fluxbooth.client)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CLOSED_PIPE = 128 + 13  # 128 + SIGPIPE, as the shell reports a process that signal ended
