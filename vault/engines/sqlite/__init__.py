"""The file vault: one SQLite file (WAL mode) beside its key in the OS keyring."""
