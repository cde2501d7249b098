"""The documentation agrees with the code: the CLI reference is what the Typer app generates today,
and the README's and the changelog's links point at files that exist. (`mkdocs build --strict`, in
.ci/run, checks the site's own links and anchors.)"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference" / "cli.md"


def test_cli_reference_is_current():
    # Loaded from its file: scripts/ is not a package, and the script is also run as a command.
    render = runpy.run_path(str(ROOT / "scripts" / "cli_reference.py"))["render"]
    assert render() == REFERENCE.read_text(encoding="utf-8"), (
        "docs/reference/cli.md is out of date: run `python scripts/cli_reference.py` and commit it")


def test_cli_reference_names_every_command_and_option():
    # Guards the generator itself: a command or option it dropped would also be missing from the file.
    import typer

    from gpt2x.cli.app import COMMANDS, app, register

    register([])
    root = typer.main.get_command(app)
    text = REFERENCE.read_text(encoding="utf-8")
    for name in COMMANDS:
        section = text.split(f"## gpt2x {name}\n", 1)[1].split("\n## gpt2x ", 1)[0]
        for param in root.commands[name].params:
            for opt in (o for o in param.opts + param.secondary_opts if o.startswith("-")):
                assert opt in section, f"gpt2x {name} {opt} is not in docs/reference/cli.md"


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md"])
def test_relative_links_exist(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    missing = [t for t in targets if t and "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"{page} links to files that do not exist: {missing}"
