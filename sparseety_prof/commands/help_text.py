"""What every command's --help is made of besides its flags: a description wrapped to the
terminal's usual width, and an epilog of examples and the exit codes that command can give."""

from __future__ import annotations

import textwrap

from sparseety_prof.commands.exit_codes import code_lines, codes_of

WIDTH = 100  # the descriptions keep their paragraphs (RawDescriptionHelpFormatter): wrapped here


def description(text: str) -> str:
    """`text`'s paragraphs (blank-line separated) wrapped to WIDTH."""
    paragraphs = [" ".join(p.split()) for p in textwrap.dedent(text).strip().split("\n\n")]
    return "\n\n".join(textwrap.fill(p, WIDTH) for p in paragraphs)


def command_epilog(command: str, examples: str, *, notes: str = "") -> str:
    """A command's --help epilog: its examples (one command a line, a `#` comment after it), any
    notes, then the exit codes it can give. Written for a root shell: no `sudo`."""
    parts = ["examples:\n" + examples.rstrip("\n") + "\n"]
    if notes:
        parts.append(notes.rstrip("\n") + "\n")
    if command == "launch":
        parts.append(
            "otherwise launch exits with the command's own status (128 + N when killed by signal N)\n"
        )
    parts.append(
        "exit codes:\n"
        + code_lines(codes_of(command))
        + "  (every code: `sparseety-prof --help`, docs/exit-codes.md)\n"
    )
    return "\n".join(parts)
