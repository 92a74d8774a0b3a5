"""The OpenBao test server: its address, admin token, the marks of every test that needs
it, and admin helpers (policies, tokens, AppRole) built with hvac and the admin token.

`scripts/with-openbao` starts a throwaway `bao server -dev` with the transit engine and
sets MEMVAULT_TEST_BAO_ADDR and MEMVAULT_TEST_BAO_TOKEN. Without it every test marked
with `MARKS` is skipped with that reason (and `-m openbao` alone is refused by conftest).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from vault.keysource.transit import Transit

ADDR_VAR = "MEMVAULT_TEST_BAO_ADDR"
TOKEN_VAR = "MEMVAULT_TEST_BAO_TOKEN"
ADDR = os.environ.get(ADDR_VAR, "")
ADMIN_TOKEN = os.environ.get(TOKEN_VAR, "")
MARKS = [
    pytest.mark.openbao,
    pytest.mark.skipif(
        not ADDR,
        reason="needs an OpenBao server: run scripts/with-openbao scripts/test -m openbao "
        f"(or set {ADDR_VAR} and {TOKEN_VAR})",
    ),
]

# What a host may do with one key (docs/fleet.md's host policy), and less. The anchor's
# rights: every host of a file vault reads and records it.
ANCHOR_POLICY = """
path "secret/data/memvault/transit/{key}/*" {{
  capabilities = ["create", "read", "update", "delete"]
}}
path "secret/metadata/memvault/transit/{key}/" {{ capabilities = ["list"] }}
"""
HOST_POLICY_WITHOUT_ANCHOR = """
path "transit/encrypt/{key}" {{ capabilities = ["update"] }}
path "transit/decrypt/{key}" {{ capabilities = ["update"] }}
path "transit/datakey/plaintext/{key}" {{ capabilities = ["update"] }}
path "transit/rewrap/{key}" {{ capabilities = ["update"] }}
"""
HOST_POLICY = HOST_POLICY_WITHOUT_ANCHOR + ANCHOR_POLICY
ENCRYPT_ONLY_POLICY = 'path "transit/encrypt/{key}" {{ capabilities = ["update"] }}\n'


def admin() -> Any:
    import hvac

    return hvac.Client(url=ADDR, token=ADMIN_TOKEN, timeout=30)


def admin_transit(key: str) -> Transit:
    """The transit key `key` as the admin token sees it (it may do everything)."""
    from vault.keysource.baotoken import Credentials
    from vault.keysource.transit import Transit

    return Transit(key, addr=ADDR, creds=Credentials(origin="the test", token=ADMIN_TOKEN))


def key_name() -> str:
    """A key of its own for each test: the tests share one server, in parallel."""
    return "memvault-test-" + secrets.token_hex(6)


def token_with(policy_hcl: str, *, ttl: str = "1h", renewable: bool = True) -> str:
    """A new token whose only rights (besides `default`: look up and renew itself) are
    `policy_hcl`."""
    client = admin()
    name = "p-" + secrets.token_hex(6)
    client.sys.create_or_update_policy(name, policy_hcl)
    answer = client.auth.token.create(policies=[name], ttl=ttl, renewable=renewable)
    return str(answer["auth"]["client_token"])


def host_token(key: str, **kw: Any) -> str:
    return token_with(HOST_POLICY.format(key=key), **kw)


def fleet_page_policies(key: str) -> tuple[str, str]:
    """The operator and host policies docs/fleet.md gives, for `key`."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "fleet.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```hcl\n")[1:]]
    assert len(blocks) == 2, "docs/fleet.md: the operator's and the host's policy"
    operator, host = (b.replace("memvault-laptop-42", key) for b in blocks)
    return operator, host
