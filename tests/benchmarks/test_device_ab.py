"""scripts/device/ab.sh: variants copied over the checkout in turns, the command run on each, the
checkout put back afterwards (files only a variant had removed)."""
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device" / "ab.sh"


def _ab(cwd: Path, *args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OUT=str(out), TAIL="1"))


def test_variants_run_in_turns_and_the_checkout_is_restored(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / "pkg").mkdir(parents=True)
    out.mkdir()
    (repo / "pkg" / "k.py").write_text("main\n")
    (repo / "keep.txt").write_text("untouched\n")
    for name, text in (("a", "variant a\n"), ("b", "variant b\n")):
        (repo / ".dev" / name / "pkg").mkdir(parents=True)
        (repo / ".dev" / name / "pkg" / "k.py").write_text(text)
    (repo / ".dev" / "b" / "extra.txt").write_text("only b\n")  # a file the checkout does not have
    r = _ab(repo, "2", "cat pkg/k.py; if test -e extra.txt; then echo extra; fi", ".dev/a", ".dev/b", out=out)
    assert r.returncode == 0, r.stderr
    # (a runs without b's extra file in round 2: each variant goes over the checkout as it was)
    assert r.stdout.splitlines() == ["== a 1 rc 0", "variant a", "== b 1 rc 0", "extra",
                                     "== a 2 rc 0", "variant a", "== b 2 rc 0", "extra"]
    assert (out / "b-2.log").read_text() == "variant b\nextra\n"  # the whole output, in $OUT
    assert (repo / "pkg" / "k.py").read_text() == "main\n" and not (repo / "extra.txt").exists()
    assert (repo / "keep.txt").read_text() == "untouched\n"


def test_a_failing_command_is_reported_and_the_checkout_still_restored(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / ".dev" / "v").mkdir(parents=True)
    out.mkdir()
    (repo / "f.txt").write_text("main\n")
    (repo / ".dev" / "v" / "f.txt").write_text("v\n")
    r = _ab(repo, "1", "cat f.txt; exit 3", ".dev/v", out=out)
    assert r.stdout.splitlines() == ["== v 1 rc 3", "v"]
    assert (repo / "f.txt").read_text() == "main\n"
    assert _ab(repo, "1", "true", ".dev/missing", out=out).returncode == 2  # no such variant folder
