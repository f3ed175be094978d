"""MkDocs hooks (mkdocs.yml `hooks:`): the pages the site builds from the code and from files outside docs/.

- `reference/cli.md`: every command of every console script in pyproject.toml's [project.scripts], with its options,
  generated from the Typer apps at build time, so the reference cannot drift from the code.
- `results/*.md`: bench/results/*.md as they are (and the files they link to), so the docs link the measured
  figures instead of pasting them; `security.md`: SECURITY.md.
- Links from a page to those repository files (`../SECURITY.md`, `../../bench/results/TABLE.md`: relative links that
  work when the Markdown is read on a forge) are pointed at their pages on the site.
"""

from __future__ import annotations

import importlib
import logging
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

import typer

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
# Material 9.8 prints a banner about its successor on every build, past --quiet; the build says what is wrong only.
os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
CLI_PAGE = "reference/cli.md"
log = logging.getLogger("mkdocs.hooks.protofl")  # a warning fails `mkdocs build --strict`
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: the command's name -> `module:attribute` of its Typer app."""
    with (REPO / "pyproject.toml").open("rb") as fh:
        return dict(tomllib.load(fh)["project"]["scripts"])


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# Typer's commands are click's (typer vendors its own click): read by duck typing, not by click's classes.
def _is_argument(param: Any) -> bool:
    return bool(param.param_type_name == "argument")


def _is_flag(param: Any) -> bool:
    return not _is_argument(param) and bool(param.is_flag)


def _option(param: Any) -> str:
    if _is_argument(param):
        return f"`{param.name.upper()}` (argument)"
    return ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])


def _default(param: Any) -> str:
    if _is_flag(param) and not param.secondary_opts:
        return "on" if param.default else "off"
    value = param.default
    if value is None or callable(value) or (_is_argument(param) and param.required):
        return ""
    if param.secondary_opts:  # --x/--no-x
        return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`" if str(value) != "" else ""


def _command(prog: str, cmd: Any, out: list[str], depth: int) -> None:
    out.append(f"{'#' * depth} `{prog}`\n")
    text = (cmd.help or "").strip()
    if text:
        out.append(_plain(text) + "\n")
    params = [p for p in cmd.params if not getattr(p, "hidden", False) and p.name not in ("help",)]
    if hasattr(cmd, "commands"):  # a group
        for name, sub in cmd.commands.items():
            if not getattr(sub, "hidden", False):
                _command(f"{prog} {name}", sub, out, depth + 1)
        return
    ctx = cmd.context_class(cmd, info_name=prog)
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    out.append(f"```text\n{prog} {usage}\n```\n")
    if not params:
        out.append("No options.\n")
        return
    out.append("| option | type | default | what it does |\n|---|---|---|---|")
    for p in params:
        kind = "flag" if _is_flag(p) else _cell(p.metavar or p.display_type(ctx).strip("<>"))
        out.append(f"| {_option(p)} | {kind} | {_default(p)} | {_cell(_plain(getattr(p, 'help', None) or ''))} |")
    out.append("")


def _plain(text: str) -> str:
    """Typer's help with rich markup ([bold]...[/bold]) and escapes taken out."""
    return re.sub(r"\[/?[a-z ]+\]", "", text).replace("\\[", "[")


def cli_reference() -> str:
    """The CLI reference page: every console script's commands and options, from the Typer apps."""
    out = [
        "# Command-line reference\n",
        "Generated from the Typer apps of `[project.scripts]` in `pyproject.toml` when the site is built "
        "(`docs/hooks/site.py`): what `--help` says, every command and option. Defaults are the ones a user gets "
        "when the option is left out.\n",
    ]
    for script, target in console_scripts().items():
        module, attr = target.split(":")
        app = getattr(importlib.import_module(module), attr)
        cmd = typer.main.get_command(app)
        out.append(f"## `{script}`\n")
        text = (cmd.help or "").strip()
        if text:
            out.append(_plain(text) + "\n")
        assert hasattr(cmd, "commands"), f"{script}: a group of commands expected"
        for name, sub in cmd.commands.items():
            if not getattr(sub, "hidden", False):
                _command(f"{script} {name}", sub, out, 3)
    return "\n".join(out) + "\n"


def outside_pages() -> dict[str, Path]:
    """Site path -> repository file for the pages built from files outside docs/ (and the files they link)."""
    pages = {"security.md": REPO / "SECURITY.md"}
    for md in sorted((REPO / "bench" / "results").glob("*.md")):
        pages[f"results/{md.name}"] = md
        for target, _ in LINK.findall(md.read_text()):
            if "://" not in target and (md.parent / target).is_file():
                pages[posixpath.normpath(f"results/{target}")] = md.parent / target
    return pages


def on_config(config: Any) -> Any:
    sys.path.insert(0, str(REPO))  # this checkout's packages, not an installed copy's
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    index = (Path(config["docs_dir"]) / "results" / "index.md").read_text()
    for md in sorted((REPO / "bench" / "results").glob("*.md")):
        if f"bench/results/{md.name})" not in index:
            log.warning(f"docs/results/index.md does not link bench/results/{md.name}: add a line for it")
    for src, path in outside_pages().items():
        if src.endswith(".md"):
            files.append(File.generated(config, src, content=path.read_text()))
        else:
            files.append(File.generated(config, src, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links to SECURITY.md and bench/results/*.md, written relative to the repository, to their site pages."""
    here = posixpath.dirname(page.file.src_uri)
    docs = Path(config["docs_dir"]).resolve()
    by_file = {path.resolve(): src for src, path in outside_pages().items()}

    def point(m: re.Match[str]) -> str:
        target, anchor = m.group(1), m.group(2) or ""
        if "://" in target:
            return m.group(0)
        src = by_file.get((docs / here / target).resolve())
        if src is None:
            return m.group(0)
        return f"]({posixpath.relpath(src, here or '.')}{anchor})"

    return LINK.sub(point, markdown)
