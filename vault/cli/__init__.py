"""The `memvault` command: parse arguments, call the library, print.

The layers: `common` (shared options, parameter types, output helpers), one module
per family of commands (`history`, `data`, `care`, `admin`, `keys` with `kept`,
`agent`, `shell`), each listing its commands in `COMMANDS`, and `app`, which
builds the group from them and maps every failure to one line and an exit code.
The Agents SDK is imported only by `demo` and `chat`.
"""

from vault.cli.app import cli, main

__all__ = ["cli", "main"]
