"""`gpt2x eval`'s runner: the tasks checked, the backend opened, lm-eval's `simple_evaluate` run with
Gpt2xLM, and the result as lm-eval's tables and as JSON."""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets.exceptions import DatasetNotFoundError
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from ..choices import BackendKind, Precision, Progress, ProviderKind, no_progress
from ..errors import HubError, UsageError
from ..evaluate import harness
from ..workflows.backends import open_backend
from .index import kept_index
from .model import DEFAULT_MAX_GEN_TOKS, DEFAULT_SEED, Gpt2xLM


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...]
    model: str | None = None
    backend: BackendKind = BackendKind.ort
    provider: ProviderKind = ProviderKind.cpu
    precision: Precision | None = None
    onnx_dir: Path | None = None
    revision: str | None = None
    threads: int | None = None
    include_paths: tuple[Path, ...] = field(default_factory=tuple)
    limit: float | None = None  # documents per task (a number below 1: that fraction of them)
    num_fewshot: int | None = None
    batch_size: int = harness.DEFAULT_BATCH_SIZE
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    seed: int = DEFAULT_SEED
    show_progress: bool = True


def _is_task_file(name: str) -> bool:
    path = Path(name)
    return path.suffix in (".yaml", ".yml") and path.is_file()


def task_manager(tasks: tuple[str, ...], include_paths: tuple[Path, ...] = ()) -> TaskManager:
    """The include paths alone when they hold every task, else lm-eval's tasks too: each folder's index read back from
    an earlier run's where its files are unchanged (index.kept_index; parsing lm-eval's ~14,000 task files takes
    seconds). An unknown task is a UsageError naming the closest names."""
    if not tasks:
        raise UsageError("no tasks given", option="tasks")
    for path in include_paths:
        if not Path(path).is_dir():
            raise UsageError(f"include path {path} is not a folder", option="include_path")
    paths = [str(p) for p in include_paths]
    with kept_index():
        if paths:
            manager = TaskManager(include_path=paths, include_defaults=False)
            if all(t in manager.all_tasks or _is_task_file(t) for t in tasks):
                return manager
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks and not _is_task_file(t)]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise UsageError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; lm-eval's task list, "
                         "and the tasks of any include path, name the known ones", option="tasks")
    return manager


def quiet_lm_eval() -> None:
    """lm-eval's own log lines (task warnings, progress notes) off stderr: errors only."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def prepare(settings: EvalSettings, progress: Progress = no_progress, notice: Progress = no_progress) -> tuple[TaskManager, Gpt2xLM]:
    """The tasks checked before any export or load, then the backend opened and wrapped."""
    manager = task_manager(settings.tasks, settings.include_paths)
    backend = open_backend(settings.backend, settings.provider, settings.model, settings.revision, settings.precision,
                           settings.onnx_dir, settings.threads, progress=progress, notice=notice)
    lm = Gpt2xLM(backend, batch_size=settings.batch_size, max_gen_toks=settings.max_gen_toks, seed=settings.seed,
                 show_progress=settings.show_progress)
    return manager, lm


def evaluate(settings: EvalSettings, manager: TaskManager, lm: Gpt2xLM) -> dict[str, Any]:
    """lm-eval's result without per-document samples, with a "gpt2x" entry saying what ran. An unloadable data
    set is a HubError."""
    try:
        result = simple_evaluate(model=lm, tasks=list(settings.tasks), task_manager=manager, limit=settings.limit,
                                 num_fewshot=settings.num_fewshot, log_samples=False,
                                 random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
                                 fewshot_random_seed=settings.seed)
    except (ConnectionError, DatasetNotFoundError) as e:  # a task's data set: not cached and no network, or not on the hub
        raise HubError(f"a task's data set cannot be loaded: {e}") from None
    if result is None:  # only on a distributed rank other than 0, which gpt2x never is
        raise UsageError("lm-eval returned no result")
    result.pop("samples", None)
    result["gpt2x"] = {**lm.get_model_info(), "precision": None if settings.precision is None else settings.precision.value,
                       "tasks": list(settings.tasks), "limit": settings.limit}
    return result


def run_eval(settings: EvalSettings, progress: Progress = no_progress, notice: Progress = no_progress) -> dict[str, Any]:
    """prepare, then evaluate."""
    return evaluate(settings, *prepare(settings, progress, notice))


def result_tables(result: dict[str, Any]) -> list[str]:
    """lm-eval's Markdown tables of the result: the tasks, and the groups when there are any."""
    tables = [make_table(result)]
    if result.get("groups"):
        tables.append(make_table(result, "groups"))
    return tables


def result_json(result: dict[str, Any]) -> str:
    """The result as JSON (lm-eval's conversion for what JSON lacks: task configs hold functions)."""
    return json.dumps(result, indent=1, default=handle_non_serializable) + "\n"
