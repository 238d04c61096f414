"""docs/tuning.md covers every knob a user can turn, each with a measured effect and the command
that measured it (or says it was not measured), every command it names exists; the README keeps
a short performance summary and links it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUNING = (ROOT / "docs" / "tuning.md").read_text()
README = (ROOT / "README.md").read_text()

KNOBS = [
    "path",
    "cpu_layout",
    "stage_bytes",
    "stage_step_bytes",
    "max_in_flight",
    "early_wake",
    "keep_warm",
    "cpus",
    "idle_issue",
    "max_batch",
    "kernel_launch_bytes",
    "calibrate",
    "pin_piece_bytes",
]


def section(heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", TUNING, re.M | re.S)
    assert m, f"docs/tuning.md has no section '## {heading}'"
    return m.group(1)


@pytest.mark.parametrize("knob", KNOBS)
def test_every_knob_has_what_when_and_a_measurement_or_says_none(knob: str) -> None:
    body = section(f"`{knob}`")
    assert "What it changes" in body and re.search(r"[Ww]hen to touch it|Touch it", body)
    measured = re.search(r"`python\s+benches/[\w/]+\.py[^`]*`", body) or "tests/test_" in body
    assert measured or "not been measured" in body or "Not measured" in body, knob
    assert f"[`{knob}`](#{knob})" in TUNING  # listed in the table


def test_the_vllm_keys_are_there() -> None:
    from blockswap._vllm_config import OPTIONS

    body = section("The vLLM keys")
    for key in [*OPTIONS, "cpu_bytes_to_use", "--kv-offloading-size"]:
        assert f"`{key}" in body, key


def test_every_command_names_a_script_that_exists() -> None:
    scripts = set(re.findall(r"python\s+(benches/[\w/]+\.py)", TUNING))
    assert len(scripts) >= 5
    for s in scripts:
        assert (ROOT / s).is_file(), s


def test_the_readme_keeps_a_summary_and_links_the_guide() -> None:
    assert "**Performance in short**" in README
    assert "[docs/tuning.md](docs/tuning.md)" in README
    # The figure-heavy paragraphs live in the guide now.
    for moved in ("**Blocks, not pages.**", "What bounds small pages is the copy engines' cost"):
        assert moved not in README and moved in TUNING
