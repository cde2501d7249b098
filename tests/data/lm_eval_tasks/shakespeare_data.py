"""The datasets of gpt2x's offline lm-eval tasks, read from the JSONL files beside this module.

The task YAMLs name these functions as `custom_dataset: !function shakespeare_data.<name>`: lm-eval
imports this file by its path and calls the function instead of `datasets.load_dataset`, so the data
is found wherever the tasks are included from and whatever the working directory (a `dataset_path:
json` task's relative `data_files` would be read from the working directory), and nothing is
downloaded. lm-eval passes the task's metadata (the model's arguments among them) as keywords:
they are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _test_split(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multiple_choice(**_metadata) -> datasets.DatasetDict:
    return _test_split("shakespeare_mc.jsonl")


def documents(**_metadata) -> datasets.DatasetDict:
    return _test_split("shakespeare_ppl.jsonl")
