"""The docs keep up with the configs: every experiment and every net has its line in
docs/configuration.md, and the README stays a front page."""

from __future__ import annotations

import re

from conftest import ROOT

CONFIGURATION = ROOT / "docs" / "configuration.md"


def listed(section: str) -> list[str]:
    """The names in the first column of the table under ``## <section>`` of docs/configuration.md."""
    parts = re.split(r"^## ", CONFIGURATION.read_text(), flags=re.M)
    body = next((p for p in parts if p.startswith(section + "\n")), "")
    assert body, f"docs/configuration.md has no '## {section}' section"
    return re.findall(r"^\| `([\w.-]+)` \|", body, flags=re.M)


def configs(group: str) -> set[str]:
    return {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}


def test_every_experiment_is_in_the_configuration_page():
    names = listed("Experiments")
    assert not configs("experiment") - set(names), "add a line to docs/configuration.md's Experiments"
    assert not set(names) - configs("experiment"), "docs/configuration.md lists experiments that do not exist"
    assert len(names) == len(set(names)), "an experiment listed twice"


def test_every_net_is_in_the_configuration_page():
    names = listed("Nets")
    assert not configs("model/net") - set(names), "add a line to docs/configuration.md's Nets"
    assert not set(names) - configs("model/net"), "docs/configuration.md lists nets that do not exist"
    assert len(names) == len(set(names)), "a net listed twice"


def test_the_readme_is_a_front_page():
    """At most 150 lines, and no wall times: those go to benchmarks/RESULTS.md with their machine."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    timings = re.findall(r"\d\s*(?:ms|min|s/step|seconds|minutes|hours?|h)\b", text)
    assert not timings, timings
