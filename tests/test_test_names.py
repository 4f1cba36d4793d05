"""pytest imports test modules by basename (rootdir import mode, no __init__.py), so two test files
with one name stop the whole suite at collection: every basename must be unique."""
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def duplicate_basenames(root: Path) -> dict[str, list[str]]:
    seen = defaultdict(list)
    for path in root.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(root)))
    return {name: sorted(paths) for name, paths in seen.items() if len(paths) > 1}


def test_test_file_basenames_are_unique():
    assert duplicate_basenames(TESTS) == {}


def test_negative_control_a_duplicate_is_found(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "test_x.py").write_text("")
    assert duplicate_basenames(tmp_path) == {"test_x.py": ["a/test_x.py", "b/test_x.py"]}
