"""Write the Tandem lm-eval tasks with an absolute GSM8K path, for `lm_eval --include_path`.

The YAMLs in tasks/ name the data relative to the repository root (../shared/data/gsm8k/),
which only resolves when lm-eval runs from there; this writes copies that work from anywhere.

    python benchmarks/lm_eval/task_dir.py [OUT_DIR]   # prints OUT_DIR (default: a new temp dir)
"""
import shutil
import sys
import tempfile
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
REPO_ROOT = TASKS_DIR.parents[2]
RELATIVE_DATA = "../shared/data/gsm8k/test.jsonl"
GSM8K_TEST = (REPO_ROOT / RELATIVE_DATA).resolve()


def write_task_dir(out_dir: Path, data_path: Path = GSM8K_TEST) -> Path:
    """Copy tasks/ into out_dir, with `data_path` in place of the relative data path."""
    if not data_path.is_file():
        raise FileNotFoundError(f"GSM8K test set not found at {data_path}; it is expected at "
                                f"<repository root>/{RELATIVE_DATA}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in TASKS_DIR.iterdir():
        if src.suffix == ".yaml":
            text = src.read_text()
            if RELATIVE_DATA not in text:
                raise ValueError(f"{src} does not name {RELATIVE_DATA}")
            (out_dir / src.name).write_text(text.replace(RELATIVE_DATA, str(data_path)))
        elif src.suffix == ".py":
            shutil.copy(src, out_dir / src.name)
    return out_dir


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tandem-lm-eval-"))
    print(write_task_dir(out))
