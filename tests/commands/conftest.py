from pathlib import Path

import pytest

from tests.flood.conftest import text_ckpt, tiny_ckpt  # noqa: F401  (checkpoint fixtures shared with flood tests)
from tests.train.post.conftest import chat_ckpt  # noqa: F401  (the fine-tuning tests' checkpoint)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory, text_corpus: Path) -> Path:
    """A finished 2-step tiny run with one checkpoint (step 2); tests damage copies of it, never the run."""
    from tests.conftest import run_lingctl

    run = tmp_path_factory.mktemp("small") / "run"
    res = run_lingctl(
        "train",
        "--preset",
        "tiny",
        "--eval-every",
        "0",
        "--steps",
        "2",
        "--save-every",
        "2",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
    )
    assert res.returncode == 0, res.stderr
    return run


# One uninterrupted 20-step run, read (never written) by the tests: the reference for kill-and-resume in
# test_train.py, and a run with checkpoints (steps 16 and 20 kept) for flood eval's run mode.
RUN20 = ("train", "--preset", "tiny", "--eval-every", "0", "--steps", "20", "--save-every", "4", "--json")


@pytest.fixture(scope="session")
def run20(tmp_path_factory: pytest.TempPathFactory, text_corpus: Path) -> tuple[Path, str]:
    from tests.conftest import run_lingctl

    run = tmp_path_factory.mktemp("run20") / "run"
    res = run_lingctl(*RUN20, "--data", str(text_corpus), "--out", str(run))
    assert res.returncode == 0, res.stderr
    return run, res.stdout
