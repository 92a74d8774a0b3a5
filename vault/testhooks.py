"""Test-only hooks, all in one place: nothing here runs unless a test asks for it.

* `failpoint(name)`: called by the library at named steps of its crash-sensitive
  operations. With MEMVAULT_FAILPOINT=name the process is SIGKILLed there; with
  MEMVAULT_PAUSEPOINT=name it says so on stderr and waits for the test's SIGINT.
  In-process tests replace the function itself (`testhooks.failpoint = ...`): the
  library always calls it as `testhooks.failpoint(...)`, so the replacement is
  the one that runs.
* `chat_test_model()`: MEMVAULT_CHAT_TEST_MODEL=module:factory makes `memvault
  chat` use `factory()` (an `agents.Model`, e.g. `agents.testing.ScriptedModel`)
  instead of a real model, so the command can be tested offline in a real
  subprocess. It says so on stderr when used and needs no API key.

Unset, each hook costs one environment lookup. This module never imports
`agents` at import time: the library imports it on every command's path.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from vault.errors import BadInput

if TYPE_CHECKING:
    from agents import Model

ENV_FAILPOINT = "MEMVAULT_FAILPOINT"
ENV_PAUSEPOINT = "MEMVAULT_PAUSEPOINT"
ENV_CHAT_TEST_MODEL = "MEMVAULT_CHAT_TEST_MODEL"


def failpoint(name: str) -> None:
    """Crash injection: SIGKILL this process (or pause it) at a named step.

    The crash tests set MEMVAULT_FAILPOINT to prove a kill at each step of a
    rotation, shred, purge, revoke or import loses nothing.
    """
    if os.environ.get(ENV_FAILPOINT) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(ENV_PAUSEPOINT) == name:
        # The interruption tests' variant: say so on stderr and wait for their SIGINT.
        sys.stderr.write(f"memvault: paused at {name}\n")
        sys.stderr.flush()
        time.sleep(600)


def chat_test_model() -> Model | None:
    """The model named by MEMVAULT_CHAT_TEST_MODEL (`module:factory`), or None when unset."""
    spec = os.environ.get(ENV_CHAT_TEST_MODEL)
    if not spec:
        return None
    # Imported here, not at the top: only `memvault chat` (which imports the SDK
    # anyway) gets this far, and every other command must not pay for `agents`.
    from agents import Model

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"{ENV_CHAT_TEST_MODEL} must be module:factory, not {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise BadInput(f"{ENV_CHAT_TEST_MODEL}={spec} cannot be loaded ({exc})") from None
    model = factory()
    if not isinstance(model, Model):
        raise BadInput(f"{ENV_CHAT_TEST_MODEL}={spec} did not return an agents.Model")
    print(
        f"memvault: {ENV_CHAT_TEST_MODEL} is set: using a test model, not a real one",
        file=sys.stderr,
        flush=True,
    )
    return model
