"""The storage engines under the vault: SQLite files and PostgreSQL."""
