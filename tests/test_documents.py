"""The documents a user follows work as written: every ``kvlab ...`` command in the README
and docs/ composes to a checked run config (sweeps value by value), the subcommands' inputs
exist, the README's Python snippet runs, and every internal link and repository path they
name resolves. Nothing heavy runs: configs are composed, not run."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvlab.config import to_run_config
from kvlab.paths import CONF_DIR

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 300


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def commands() -> list[tuple[str, str]]:
    """(document, command) for every ``kvlab ...`` line of a bash block, comments cut."""
    out = []
    for path in DOCUMENTS:
        for block in code_blocks(path, "bash"):
            lines = block.replace("\\\n", " ").splitlines()
            for line in lines:
                line = line.split(" #")[0].strip()
                if line.startswith("kvlab "):
                    out.append((path.relative_to(ROOT).as_posix(), line))
    return out


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """A sweep's overrides point by point: the i-th value of every swept key (the last where
    a key has fewer), so every value is composed once."""
    values = []
    for override in overrides:
        key, sep, value = override.partition("=")
        swept = sep and "," in value and not value.startswith(("[", "{", "'", '"'))
        values.append([f"{key}={v}" for v in value.split(",")] if swept else [override])
    width = max((len(v) for v in values), default=1)
    return [[v[min(i, len(v) - 1)] for v in values] for i in range(width)]


def check_composes(overrides: list[str]) -> None:
    """As ``kvlab`` composes a command line, point by point."""
    launchers = [o for o in overrides if o.startswith("hydra/launcher=")]
    for launcher in launchers:  # a Hydra plugin's preset: it exists, the plugin composes it
        name = launcher.partition("=")[2]
        assert (Path(CONF_DIR) / "hydra" / "launcher" / f"{name}.yaml").is_file(), launcher
    overrides = [o for o in overrides if o not in launchers and not o.startswith("hydra.")]
    for point in sweep_points(overrides):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            to_run_config(compose(config_name="config", overrides=point))


COMMANDS = commands()


def test_the_documents_have_commands_to_check():
    assert len(COMMANDS) >= 20
    assert {doc for doc, _ in COMMANDS} >= {"README.md", "docs/running.md"}


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_each_command_runs_as_written(doc, command):
    words = shlex.split(command)[1:]
    if any("<" in w for w in words):  # a placeholder the reader fills (<sweep_dir>)
        return
    head = words[0]
    if head == "memory":
        from kvlab.cli import memory_main

        with contextlib.redirect_stdout(io.StringIO()) as printed:
            memory_main(words[1:])
        assert "KV cache at context=" in printed.getvalue()
    elif head == "lm-eval":
        args = dict(zip(words[1::2], words[2::2], strict=False))
        assert args["--model"] == "kvlab", command
        model_args = dict(pair.split("=", 1) for pair in args["--model_args"].split(","))
        check_composes([f"{k}={v}" for k, v in model_args.items()])
        tasks = ROOT / "kvlab" / "eval" / "lm_eval_tasks"
        for task in args["--tasks"].split(","):
            assert list(tasks.rglob(f"{task}.yaml")), f"{doc}: no lm-eval task {task}"
    elif head == "diagnose":
        check_composes(words[1:])
    elif head == "serve":  # the server's flags apart, the run's overrides compose
        from kvlab.serving.serve import parse_args

        _, overrides = parse_args(words[1:])
        check_composes(["workload=serving", *overrides])
    elif head in ("report", "wandb-view"):
        raise AssertionError(f"{doc}: {command!r} names no placeholder to fill")
    else:
        check_composes([w for w in words if w != "-m"])


def test_the_readme_is_a_guide_not_a_notebook():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md is {len(lines)} lines"
    assert lines[3:5] == [
        "bash scripts/demo.sh   # install everything, sweep the KV strategies on the embedded "
        "model, print the comparison table",
        "bash scripts/test.sh   # install everything, run the test suite (slow tests included)",
    ]


def test_the_readme_python_snippet_runs(smollm2, monkeypatch, capsys):
    """The README's Python block, as written, on the default model (loaded once a session)."""
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *args, **kwargs: smollm2)
    [snippet] = code_blocks(ROOT / "README.md", "python")
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert len(smollm2[1](printed)["input_ids"]) >= 16  # it streamed a continuation


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


REPO_PATH = re.compile(r"`((?:kvlab|scripts|experiments|docs|conf|tests)/[\w./-]+)`")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_paths_resolve(path):
    """Every relative link (and its #anchor) and every `folder/file` path a document names
    exists (../shared only where that folder is beside the checkout, as in CI)."""
    for link in _links(path):
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if "../shared" in target and not (ROOT.parent / "shared").is_dir():
            continue
        assert resolved.exists(), f"{path.name}: link {link} does not resolve"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{path.name}: no #{anchor}"
    for named in REPO_PATH.findall(re.sub(r"```.*?```", "", path.read_text(), flags=re.S)):
        if "<" in named or "*" in named:
            continue
        assert (ROOT / named.rstrip("/")).exists(), f"{path.name}: `{named}` does not exist"
