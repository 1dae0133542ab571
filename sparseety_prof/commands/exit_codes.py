"""The exit codes every command documents (the ProfError subclasses carry theirs)."""

EXIT_CODES_HELP = """exit codes:
  0  success              3  no such process        6  unsupported engine build
  1  other failure        4  not a supported engine 7  corrupt recording
  2  usage error          5  missing privileges     8  BPF unavailable (BCC, headers, kernel)
  9  check: a capture layer lost the request id
  10 the recording could not be written (disk full, I/O error): meta.json says complete: false
  11 collect: some recordings were refused (each is named); the others were collected
  12 --late-attach: ptrace not permitted (Yama ptrace_scope, no CAP_SYS_PTRACE, already traced)
  13 --late-attach: the target cannot load the library (static, other mount namespace, dlopen failed)
  14 --metrics-port cannot be served (port in use, address not on this host)
"""

CHECK_FAILED = 9  # `check`: the request id did not reach every capture layer
COLLECT_REFUSED = 11  # `collect`: at least one recording was refused (the rest were collected)
