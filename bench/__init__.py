"""memvault benchmarks, one module per group of figures (see bench/README.md).

- main: the flags (`--quick`, `--scale`, `--only GROUP`, `--json-out`) and the run;
- common: configuration, side-by-side timing, figures, the table;
- data, workspace, procs: the items, the files, the timed processes;
- sessions, cli, rotation, scale, postgres (with pgserver), transit: one module per
  `--only` group.
"""

import sys

# Checked here, before any group module imports memvault: a setup problem gets one line.
try:
    import cryptography.fernet  # noqa: F401

    import vault  # noqa: F401
except ImportError as _exc:  # pragma: no cover - a setup problem, not a benchmark result
    sys.exit(
        f"bench: cannot import memvault ({_exc}); run scripts/bootstrap and use .venv/bin/python"
    )
