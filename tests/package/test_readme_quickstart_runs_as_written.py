"""README.md stays short, its quickstart runs as written, and its command table is complete.

The quickstart is taken from README.md and run step by step, each step a real process,
with a HOME of its own (so the vault lands in its default place) and the keyring of the
test run: the private Secret Service under scripts/test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tests.conftest import ROOT, run_on_terminal

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
# scripts/bootstrap has made this very install in .venv (`pip install -e '.[test,postgres]'`),
# and a test cannot reach a package index: this is the one line the test does not run.
INSTALL = "pip install -e ."
PASSPHRASE = "a quickstart passphrase, long enough"


def section(title: str) -> str:
    """The text of README.md's `## title` section, up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(title: str) -> list[tuple[str, str]]:
    """The fenced blocks of a section, as (language, body)."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(section(title))]


def test_readme_is_at_most_250_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_opens_with_the_two_commands() -> None:
    first_block = FENCE.search(README.read_text())
    assert first_block is not None
    commands = [line.split()[0] for line in first_block.group(2).splitlines()]
    assert commands == ["scripts/demo", "scripts/test"]
    for command in commands:
        assert os.access(ROOT / command, os.X_OK), command


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


def cli_commands() -> set[str]:
    """Every command `memvault --help` lists, a group's as `group sub`."""
    from vault.cli import cli

    names: set[str] = set()
    for name, command in cli.commands.items():
        if command.hidden:
            continue
        if isinstance(command, click.Group):
            names |= {f"{name} {sub}" for sub, c in command.commands.items() if not c.hidden}
        else:
            names.add(name)
    return names


def table_commands() -> set[str]:
    """The command names in the first column of README.md's command table."""
    names: set[str] = set()
    for row in section("Commands").splitlines():
        if not row.startswith("| `"):
            continue
        first_cell = re.split(r"(?<!\\)\|", row)[1]
        for usage in re.findall(r"`([^`]+)`", first_cell):
            words = usage.removeprefix("memvault ").split()
            names.add(" ".join(words[:2]) if words[0] == "key" else words[0])
    return names


def test_the_command_table_names_every_command_and_no_other() -> None:
    assert {"key list", "key forget", "restore"} <= cli_commands()
    assert table_commands() == cli_commands()


def quickstart_steps() -> tuple[list[str], str, str]:
    """The quickstart's shell lines, and the Python file it tells to save, with its name."""
    shell: list[str] = []
    python: list[str] = []
    for language, body in blocks("Quickstart"):
        if language == "sh":
            shell += [line for line in body.splitlines() if line.strip()]
        else:
            assert language == "python", language
            python.append(body)
    assert len(python) == 1, "the quickstart shows one Python file"
    saved_as = re.findall(r"Save this as `([\w.]+)`", section("Quickstart"))
    assert len(saved_as) == 1
    return shell, saved_as[0], python[0]


@pytest.mark.slow
def test_the_quickstart_runs_as_written_offline(tmp_path: Path) -> None:
    shell, filename, program = quickstart_steps()
    assert shell[0].split("#")[0].strip() == INSTALL
    assert shell[-1].split()[:3] == ["memvault", "key", "export"]
    assert "agents.testing import ScriptedModel" in program and "asyncio.run(" in program

    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / filename).write_text(program)
    env = dict(os.environ)
    for name in ("MEMVAULT_DB", "XDG_DATA_HOME", "OPENAI_API_KEY"):
        env.pop(name, None)
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    bash = shutil.which("bash", path=env["PATH"])
    assert bash is not None

    outputs: list[str] = []
    for line in shell[1:]:
        if line.startswith("memvault key export"):
            # The kit's passphrase is typed at a terminal, as a user would.
            code, raw = run_on_terminal(
                [],
                [(b"Recovery kit passphrase", PASSPHRASE), (b"Repeat the passphrase", PASSPHRASE)],
                argv=[bash, "-c", line],
                cwd=work,
                env=env,
            )
            out, err = raw.decode(errors="replace"), ""
        else:
            proc = subprocess.run(
                [bash, "-c", line],
                input="",
                capture_output=True,
                text=True,
                env=env,
                cwd=work,
                timeout=240,
            )
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        assert code == 0, f"{line!r} exited {code}: {out[-1500:]} {err[-1500:]}"
        if line.startswith("python "):
            assert err == "", f"{line!r} wrote to stderr: {err}"
        outputs.append(out)

    # What the comments beside the lines promise: the second process sent the model
    # the first turn, read back from the vault, and `show` prints all four items.
    runs = [out for line, out in zip(shell[1:], outputs, strict=True) if "python " in line]
    assert [r.strip().rsplit(" ", 1)[-1] for r in runs] == ["1", "3"], runs
    shown = outputs[[i for i, line in enumerate(shell[1:]) if "show demo" in line][0]]
    assert "NORD-17" in shown and shown.count("#") == 4, shown

    db = home / ".local/share/memvault/history.db"
    assert db.is_file()
    for part in db.parent.iterdir():
        assert b"NORD-17" not in part.read_bytes(), part
    kit = work / "kit.json"
    assert kit.is_file() and kit.stat().st_mode & 0o777 == 0o600
    assert PASSPHRASE.encode() not in kit.read_bytes()
