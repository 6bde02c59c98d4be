from __future__ import annotations

import ast
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects

from lingctl.model import checkpoint_files as files
from lingctl.model import hub

# What a Hub download must bring for flood and --init-from to read the directory.
MODEL_DIR_FILES = (
    files.CONFIG,
    files.GENERATION_CONFIG,
    files.WEIGHTS,
    files.WEIGHTS_INDEX,
    files.SHARD_NAME.format(index=1, total=2),
    files.TOKENIZER,
    files.TOKENIZER_CONFIG,
    files.SPECIAL_TOKENS_MAP,
    files.CHAT_TEMPLATE,
)
# Training state: never fetched from the Hub (pickles among them).
TRAINING_FILES = (f"{files.STATE_DIR}/.metadata", files.TRAIN_CONFIG, files.LEGACY_TRAIN_STATE)


def _downloaded(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that ``core.hub`` fetches, filtered as ``snapshot_download`` filters them."""
    return list(filter_repo_objects(names, allow_patterns=list(hub.MODEL_FILES), ignore_patterns=list(hub.SKIP_FILES)))


def test_hub_downloads_every_model_directory_file() -> None:
    # core cannot import lingctl.model, so hub spells its patterns itself; this keeps the two in step.
    assert hub.CONFIG_FILE == files.CONFIG
    assert _downloaded(MODEL_DIR_FILES) == list(MODEL_DIR_FILES)
    assert _downloaded(TRAINING_FILES) == []


def test_checkpoint_files_imports_nothing() -> None:
    # Read on command start-up paths: an import here (torch above all) would be paid by every command.
    tree = ast.parse(Path(files.__file__).read_text())
    assert [type(node).__name__ for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)] == []
    names = {k: v for k, v in vars(files).items() if k.isupper()}
    assert len(set(names.values())) == len(names), names  # no two roles share a file name
