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


def test_the_built_site_shows_no_escaping_backslash_and_nested_lists_as_lists(tmp_path):
    """The site built by mkdocs and read in headless Chromium, as a reader sees it: the CLI reference shows option
    metavars with their pipes and no backslash (backtick spans had shown `<torch\\|ort\\|...>`, 24 times), and the
    generate guide's nested list renders inside its list item (indented by two spaces, it ran into the item's text)."""
    import os
    import subprocess
    import sys

    from playwright.sync_api import sync_playwright

    from gpt2x.runtime.web import CHROMIUM_ARGS, chromium_path

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, check=True,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto((site / "reference" / "cli" / "index.html").as_uri())
            text = page.inner_text("article")
            assert "\\|" not in text and "\\<" not in text
            assert "--prefill auto|onnxruntime|openvino" in text and "--backend <torch|ort|openvino|genai|web>" in text
            page.goto((site / "commands" / "generate" / "index.html").as_uri())
            nested = page.locator("article li li").all_inner_texts()
            assert any(t.startswith("oneOf is enforced as anyOf") for t in nested), nested
        finally:
            browser.close()


def test_the_readmes_structured_output_example_runs_as_shown(export_dir):
    """The README's line, run from the repository's root as a reader of a clone runs it (the schema it names is
    shipped in examples/): its text after the prompt is JSON that the schema accepts (jsonschema, not gpt2x)."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    import jsonschema

    line = next(ln for ln in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if "--json-schema" in ln)
    args = shlex.split(line.split("#", 1)[0])
    assert args[:2] == ["gpt2x", "generate"]
    env = {**os.environ, "GPT2X_EXPORTS": str(export_dir.parent), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "gpt2x", *args[1:]], cwd=ROOT, capture_output=True, text=True, encoding="utf-8", env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    prompt = args[2]
    assert r.stdout.startswith(prompt)
    schema = json.loads((ROOT / args[args.index("--json-schema") + 1]).read_text())
    jsonschema.validate(json.loads(r.stdout[len(prompt):]), schema)
