"""A technique is its two modules: each is named in code (identifiers and strings, docstrings included;
comments not) by at most 4 files of the product: its server module, its device module, the presets and
at most one registry. The round machine, the I/O shell, the agent and the trainer name none. FedProx, added
after the contract was, is named by its two modules only (and its two entry-point lines in pyproject.toml).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protofl", "edge_agent", "broker_server", "export")
# How a file names each technique. FedProx by its name, its option (prox_mu) or its term: "prox" as a word of
# an identifier or string, or "proximal"; not "proxy" (the link-shaping proxies) nor "approx".
PATTERNS = {t: rf"(?<![a-z]){t}|fed{t}" for t in ("pagr", "erpa", "apud", "cps")} | {
    "prox": r"fedprox|(?<![a-z])prox(?![a-z])|proximal"
}
TECHNIQUES = tuple(PATTERNS)
GENERIC = (
    "broker_server/core/rounds.py",
    "broker_server/core/shell.py",
    "broker_server/core/stages.py",
    "edge_agent/core/agent.py",
    "edge_agent/training/trainer.py",
    "protofl/plan.py",
    "protofl/config.py",
    "protofl/registry.py",
    "protofl/technique.py",
    "edge_agent/techniques/__init__.py",
)


def named_in(path: Path) -> set[str]:
    """The techniques a file names in identifiers or strings."""
    found: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            text = tok.string.lower()
            found.update(t for t, pattern in PATTERNS.items() if re.search(pattern, text))
    return found


def files_naming() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {t: [] for t in TECHNIQUES}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for t in named_in(path):
                out[t].append(str(path.relative_to(ROOT)))
    return out


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_technique_is_named_by_at_most_four_files(technique: str) -> None:
    files = files_naming()[technique]
    assert len(files) <= 4, f"'{technique}' is named in {len(files)} files: {files}"


def test_fedprox_is_named_by_its_two_modules_and_its_entry_points_only() -> None:
    assert sorted(files_naming()["prox"]) == ["edge_agent/techniques/fedprox.py", "protofl/algorithms/fedprox.py"]
    text = (ROOT / "pyproject.toml").read_text()
    contract = text.index('id = "technique-homes"')  # the import contract lists every technique module: not a use
    outside = text[:contract] + text[text.index("\n[[", contract) :]
    lines = [line for line in outside.splitlines() if "prox" in line.lower()]
    assert lines == [
        'fedprox = "protofl.algorithms.fedprox:FedProx"',
        'fedprox = "edge_agent.techniques.fedprox:FedProxDevice"',
    ], lines


def test_the_generic_modules_name_no_technique() -> None:
    named = {f: sorted(named_in(ROOT / f)) for f in GENERIC if (ROOT / f).exists()}
    assert not any(named.values()), {f: t for f, t in named.items() if t}


def test_the_counter_sees_identifiers_strings_and_docstrings_but_not_comments(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('"""Doc about CPS; a hyperparameter."""\n# erpa in a comment\nx_apud = "fedpagr"\n')
    assert named_in(src) == {"cps", "apud", "pagr"}
    src.write_text('"""Through a link proxy; approx."""\n# FedProx in a comment\nLinkProxy = 1\n')
    assert named_in(src) == set()
    for code in ("mu = cfg.prox_mu\n", 'x = "FedProx"\n', '"""The proximal term."""\n'):
        src.write_text(code)
        assert named_in(src) == {"prox"}, code


def test_the_import_contract_keeps_every_technique_module_out_of_the_generic_ones() -> None:
    # Concepts, not spellings: `lint-imports` (the README's test command) enforces that the generic modules import
    # no technique module; this checks that its contract lists every technique this package registers and every
    # generic module above, so that a new technique or generic module cannot slip past it.
    import sys
    from importlib.metadata import entry_points

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c["id"] == "technique-homes")
    ours = {
        ep.value.split(":")[0]
        for group in ("protofl.techniques", "protofl.device_rules")
        for ep in entry_points(group=group)
        if ep.value.startswith(("protofl.", "edge_agent."))
    }
    missing = sorted(ours - set(contract["forbidden_modules"]))
    assert len(ours) >= 14 and not missing, missing
    generic = {f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in GENERIC}
    assert generic <= set(contract["source_modules"]), sorted(generic - set(contract["source_modules"]))
    assert contract["as_packages"] is False  # a technique's own device module may import its server half
