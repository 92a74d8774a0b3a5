"""Reading PostgreSQL URLs and hiding their passwords: no server, no driver needed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vault.engines.postgres import url as pgurl
from vault.errors import BadInput

PASSWORDS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30
)


@given(PASSWORDS)
def test_any_password_is_hidden_however_it_is_typed(secret: str) -> None:
    url = f"postgresql+asyncpg://agent:{secret}@db.example:5432/memory?schema=vault_a"
    assert pgurl.redact_url(url) == (
        "postgresql+asyncpg://agent:***@db.example:5432/memory?schema=vault_a"
    )


@given(PASSWORDS)
def test_a_url_that_is_refused_never_shows_its_password(secret: str) -> None:
    url = f"postgresql+asyncpg://agent:{secret}@db.example:5432/memory?schema=vault_a"
    try:
        loc = pgurl.parse(url)
    except BadInput as exc:
        assert f":{secret}@" not in str(exc)
        assert "agent:***@db.example" in str(exc)
    else:
        assert loc.display == pgurl.redact_url(url)
        assert f":{secret}@" not in repr(loc)


@pytest.mark.parametrize("secret", ["pa/ss", "pa?schema=x", "p#w", "a/b?c#d@e"])
def test_an_unencoded_separator_in_the_password_is_refused_with_the_fix(secret: str) -> None:
    url = f"postgresql+asyncpg://agent:{secret}@db.example/memory?schema=vault_a"
    with pytest.raises(BadInput) as caught:
        pgurl.parse(url)
    message = str(caught.value)
    assert "percent-encode" in message and "%2F" in message
    assert secret not in message and "agent:***@db.example" in message


def test_a_percent_encoded_password_is_read_whole() -> None:
    loc = pgurl.parse("postgresql+asyncpg://agent:pa%2Fss%3F%23@db.example/memory?schema=v")
    assert loc.schema == "v"
    assert loc.dsn == "postgresql://agent:pa%2Fss%3F%23@db.example/memory"
    assert "pa%2F" not in loc.display


def test_passwords_in_the_query_are_hidden_too() -> None:
    shown = pgurl.redact_url("postgresql://db.example/memory?user=a&password=s3cret&schema=v")
    assert "s3cret" not in shown and "password=***" in shown


@pytest.mark.parametrize(
    ("db", "env", "expected"),
    [
        ("postgresql+asyncpg://u:p@h/db", None, "postgresql+asyncpg://u:p@h/db"),
        ("POSTGRES://h/db", None, "POSTGRES://h/db"),
        ("postgresql+psycopg://h/db", None, "postgresql+psycopg://h/db"),  # parse refuses it
        ("postgresql.db", None, None),
        ("./postgresql://x", None, None),
        (None, "postgresql://h/db", "postgresql://h/db"),
        (None, "", None),
        ("history.db", "postgresql://h/db", None),  # --db wins over $MEMVAULT_DB
    ],
)
def test_a_url_is_told_from_a_path_without_reading_it(
    db: str | None, env: str | None, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vault.paths import postgres_url

    monkeypatch.delenv("MEMVAULT_DB", raising=False)
    if env is not None:
        monkeypatch.setenv("MEMVAULT_DB", env)
    assert postgres_url(db) == expected
