"""Training the small Shakespeare GPT-2 (the bundled model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..choices import Progress, no_progress
from ..runtime.registry import require_export_extra


def train_model(corpus: Path, out: Path, steps: int, seed: int, log: Progress = no_progress) -> dict[str, Any]:
    """Train the small Shakespeare GPT-2 (the bundled model) and write it with its model card."""
    require_export_extra("training")
    from ..model.train import TrainSettings, train, write_card

    record = train(corpus, out, TrainSettings(steps=steps, seed=seed), log=log)
    write_card(out, record, f"gpt2x train --corpus {corpus} --out {out} --steps {steps} --seed {seed}")
    return record
