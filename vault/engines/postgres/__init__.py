"""The PostgreSQL vault: the same rows in a schema of a PostgreSQL database."""
