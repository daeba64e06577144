"""benchmarks/suite_time.py: the suite of a baseline commit against HEAD's, on a small git repository of its own."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import suite_time  # noqa: E402

BEFORE = "def test_one():\n    assert True\n"
AFTER = BEFORE + "\ndef test_two():\n    assert True\n\ndef test_three():\n    assert 1 == 2\n"


def _commit(repo: Path, text: str, message: str) -> str:
    (repo / "t").mkdir(exist_ok=True)
    (repo / "t" / "test_x.py").write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", message], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_each_side_runs_its_own_commits_tests_and_the_ratio_is_of_their_times(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = _commit(repo, BEFORE, "one test")
    _commit(repo, AFTER, "three tests, one failing")
    result = suite_time.compare(before, runs=1, workers=0, select=["t"], python=sys.executable, repo=repo)
    (b,), (a,) = result["runs"]["before"], result["runs"]["after"]
    assert b["counts"] == {"passed": 1} and b["returncode"] == 0
    assert a["counts"] == {"passed": 2, "failed": 1} and a["returncode"] == 1
    assert result["ratio"] == pytest.approx(a["seconds"] / b["seconds"])
    table = suite_time.report(result, before)
    assert f"| before 1 | {before} | 1 passed |" in table and "| after 1 | HEAD | 1 failed, 2 passed |" in table


def test_a_baseline_that_is_not_a_commit_is_named(tmp_path):
    with pytest.raises(ValueError, match="'no-such-rev' is not a commit"):
        suite_time.checkout(REPO, "no-such-rev", tmp_path / "x")
