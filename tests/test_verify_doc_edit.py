"""docs/VERIFY.md's "qie edit and the UI" table names every ``qie edit`` flag and every UI setting: a flag or a
setting added without saying how the fake-device check covers it fails here."""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "VERIFY.md"


def table_rows() -> set[str]:
    text = DOC.read_text()
    section = text.split("## qie edit and the UI", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[1] and not set(cells[0]) <= set("- "):
            rows.add(re.sub(r"`", "", cells[0]))
    return rows - {"option"}  # the header


def edit_flags() -> set[str]:
    from diffsynth_qie.cli import build_parser

    parser = build_parser()
    edit = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["edit"]
    return {next(o for o in a.option_strings if o.startswith("--")) for a in edit._actions
            if a.option_strings and "--help" not in a.option_strings}


def test_every_qie_edit_flag_and_ui_setting_has_a_row():
    from diffsynth_qie.ui.settings import SETTINGS

    rows = table_rows()
    wanted = edit_flags() | {f"UI {s.name}" for s in SETTINGS}
    assert wanted - rows == set(), "add these to docs/VERIFY.md (## qie edit and the UI)"
    assert rows - wanted == set(), "these rows name no qie edit flag or UI setting"
