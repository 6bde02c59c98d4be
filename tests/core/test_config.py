from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from lingctl.core.config import build, from_mapping, parse_override, to_dict
from lingctl.core.errors import NotFoundError, UsageError


@dataclass(kw_only=True, slots=True)
class Optim:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str
    steps: int = 100
    dtype: Literal["float32", "bfloat16"] = "float32"
    out: Path | None = None
    data: list[str] = field(default_factory=list)
    resume: bool = False
    optim: Optim = field(default_factory=Optim)

    def validate(self) -> None:
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_file_then_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, '[train]\nname = "a"\nsteps = 10\ndata = ["x", "y"]\n[train.optim]\nlr = 1e-3\n')
    cfg = build(RunConfig, file=path, section="train", overrides={"steps": 20, "out": None, "optim.betas": [0.8, 0.9]})
    assert cfg == RunConfig(name="a", steps=20, data=["x", "y"], optim=Optim(lr=1e-3, betas=(0.8, 0.9)))
    assert to_dict(cfg)["optim"] == {"lr": 1e-3, "betas": [0.8, 0.9]}


def test_overrides_alone_and_coercion() -> None:
    cfg = build(RunConfig, overrides={"name": "b", "steps": "1_000", "resume": "yes", "out": "~/runs", "data": "a,b"})
    assert (cfg.steps, cfg.resume, cfg.data) == (1000, True, ["a", "b"])
    assert cfg.out == Path("~/runs").expanduser()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "a", "stepz": 1}, "unknown setting 'stepz'"),
        ({"steps": 1}, "missing required setting 'name'"),
        ({"name": "a", "steps": "many"}, "steps must be an integer"),
        ({"name": "a", "steps": 1.5}, "steps must be an integer"),
        ({"name": "a", "dtype": "fp8"}, "dtype must be one of 'float32', 'bfloat16'"),
        ({"name": "a", "optim": {"lr": "fast"}}, "optim.lr must be a number"),
        ({"name": "a", "optim": {"momentum": 1}}, "unknown setting 'optim.momentum'"),
        ({"name": "a", "steps": 0}, "steps must be positive"),
        ({"name": 5}, "name must be a string"),
    ],
)
def test_errors_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        from_mapping(RunConfig, data, where="run.toml")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        build(RunConfig, file=tmp_path / "absent.toml")
    with pytest.raises(UsageError, match="invalid TOML"):
        build(RunConfig, file=write(tmp_path, "name = \n"))


def test_parse_override() -> None:
    assert parse_override("optim.lr=3e-4") == ("optim.lr", 3e-4)
    assert parse_override("name=run1") == ("name", "run1")
    assert parse_override("data=[1, 2]") == ("data", [1, 2])
    assert parse_override("resume = true") == ("resume", True)
    with pytest.raises(UsageError):
        parse_override("novalue")
