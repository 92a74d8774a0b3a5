#!/usr/bin/env python3
"""memvault benchmarks: the entry point that bench/README.md and CI run.

    scripts/with-keyring .venv/bin/python bench/run.py [--quick] [--json-out PATH]

The benchmark itself is the `bench` package around this file: bench/main.py has
the flags, and each `--only` group has a module of its own (bench/__init__.py).
"""

import sys
from pathlib import Path

# Run as a script, Python puts bench/ on the path, not the checkout holding the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
