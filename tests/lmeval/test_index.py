"""lm-eval's task index kept between runs (gpt2x.lmeval.index): what a TaskManager reads back is what lm-eval's own
TaskIndex.build makes of the same folders (the reference), a later run parses nothing while the task files are
unchanged, and a changed, added or removed file, a damaged kept file or GPT2X_LMEVAL_INDEX=off parses them again."""

from __future__ import annotations

import inspect
import os
import shutil

import pytest
from lm_eval.tasks import TaskManager
from lm_eval.tasks import manager as lm_manager
from lm_eval.tasks._index import TaskIndex

from gpt2x.lmeval import index
from gpt2x.lmeval.run import task_manager

from ..helpers import REPO

TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
BUILD = TaskIndex.build  # lm-eval's own, taken before any test patches it

BASE = "output_type: multiple_choice\ntest_split: test\ndoc_to_target: 0\n"
FILES = {
    "base.yaml": BASE,  # no task of its own: lm-eval skips it, the others include it
    "one.yaml": "include: base.yaml\ntask: one\ntag: [letters, firsts]\ndoc_to_choice: {0: a, 1: b}\n"
                "process_docs: !function utils.process\n",
    "sub/two.yaml": "include: ../base.yaml\ntask: two\ntag: letters\nnum_fewshot: 2\nweight: 0.5\n",
    "sub/group.yaml": "group: both\ntask: [one, two]\naggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\n",
    "__pycache__/ignored.yaml": "task: ignored\n",
}


def write_tasks(root, files=FILES):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def as_tuples(idx: dict) -> dict:
    return {k: (e.name, e.kind, e.yaml_path, e.cfg, e.tags) for k, e in idx.items()}


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """GPT2X_LMEVAL_INDEX in this test's folder, and the folders lm-eval itself parsed (its TaskIndex.build, counted)."""
    monkeypatch.setenv(index.INDEX_ENV, str(tmp_path / "kept"))
    parsed = []

    def counted(paths, *, resolve_includes=True):
        paths = list(paths)
        parsed.extend(paths)
        return BUILD(paths, resolve_includes=resolve_includes)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(counted))
    return parsed


def kept_build(paths):
    with index.kept_index():
        return TaskIndex.build(paths)


def test_a_folders_index_is_lm_evals_own_and_a_later_run_parses_nothing(tmp_path, kept):
    root = write_tasks(tmp_path / "tasks")
    want = as_tuples(BUILD([root]))
    assert {"one", "two", "both", "letters", "firsts"} == set(want) and want["one"][3]["doc_to_choice"] == {0: "a", 1: "b"}
    assert as_tuples(kept_build([root])) == want and kept == [root]
    [file] = (tmp_path / "kept").iterdir()
    assert as_tuples(kept_build([root])) == want and kept == [root]  # read back: nothing parsed
    assert as_tuples(kept_build([tmp_path / "x" / ".." / "tasks"])) == want and kept == [root]  # the same folder
    assert TaskIndex.build.__name__ == "counted"  # lm-eval's own is back after each


def test_a_changed_added_or_removed_task_file_is_parsed_again(tmp_path, kept):
    root = write_tasks(tmp_path / "tasks")
    kept_build([root])
    changes = [lambda: (root / "sub" / "two.yaml").write_text(FILES["sub/two.yaml"] + "num_fewshot: 5\n"),
               lambda: (root / "three.yaml").write_text("include: base.yaml\ntask: three\n"),
               lambda: (root / "one.yaml").unlink(),
               lambda: os.utime(root / "base.yaml", ns=(0, 0))]  # an included file, touched alone
    for i, change in enumerate(changes, 2):
        change()
        assert as_tuples(kept_build([root])) == as_tuples(BUILD([root])) and len(kept) == i


def test_a_damaged_kept_file_is_parsed_again_and_off_keeps_nothing(tmp_path, kept, monkeypatch):
    root = write_tasks(tmp_path / "tasks")
    kept_build([root])
    [file] = (tmp_path / "kept").iterdir()
    whole = file.read_bytes()
    for damage in (whole[: len(whole) // 2], b"", b"\x00garbage"):
        file.write_bytes(damage)
        assert as_tuples(kept_build([root])) == as_tuples(BUILD([root]))
    assert len(kept) == 4
    monkeypatch.setenv(index.INDEX_ENV, "off")
    shutil.rmtree(tmp_path / "kept")
    kept_build([root])
    kept_build([root])
    assert len(kept) == 6 and not (tmp_path / "kept").exists()


def test_folders_merge_as_lm_eval_merges_them_the_later_name_winning(tmp_path, kept):
    first = write_tasks(tmp_path / "first")
    second = write_tasks(tmp_path / "second", {"base.yaml": BASE, "one.yaml": "include: base.yaml\ntask: one\ntag: seconds\n"})
    kept_build([first, second])
    got = kept_build([first, second])
    assert as_tuples(got) == as_tuples(BUILD([first, second])) and got["one"].yaml_path == second / "one.yaml"
    assert len(kept) == 2


def test_a_task_manager_on_the_kept_index_loads_the_tasks_as_on_its_own(tmp_path, kept, monkeypatch):
    """gpt2x eval's TaskManager (run.task_manager), its index read back, against lm-eval's own: the same names, and
    the bundled offline tasks load to the same configs."""
    monkeypatch.chdir(tmp_path)
    names = ("gpt2x_shakespeare_mc", "gpt2x_shakespeare_ppl")
    own = TaskManager(include_path=str(TASKS), include_defaults=False)  # parses (not kept)
    task_manager(names, (TASKS,))  # parses, and keeps
    manager = task_manager(names, (TASKS,))
    assert len(kept) == 2 and manager.all_tasks == own.all_tasks
    loaded, want = manager.load(list(names))["tasks"], own.load(list(names))["tasks"]
    assert set(loaded) == set(want) == set(names)
    for name in names:
        assert loaded[name].config.to_dict() == want[name].config.to_dict()


def test_lm_evals_names_that_the_index_takes_the_place_of_are_there():
    """lm-eval's TaskManager builds its index through manager.TaskIndex.build(paths, *, resolve_includes), which
    kept_index replaces while it runs and puts back; the fingerprint walks a folder with TaskIndex._iter_yaml_files(root),
    the walk build reads."""
    assert lm_manager.TaskIndex is TaskIndex
    params = inspect.signature(BUILD).parameters
    assert list(params) == ["paths", "resolve_includes"] and params["resolve_includes"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(TaskIndex._iter_yaml_files).parameters) == ["root"]
    assert "_iter_yaml_files(root)" in inspect.getsource(BUILD)
    assert "index.build(all_paths)" in inspect.getsource(lm_manager.TaskManager.__init__)
    with index.kept_index():
        assert TaskIndex.build is not BUILD
    assert TaskIndex.build is BUILD
