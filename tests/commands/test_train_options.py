"""`lingctl train`'s options per setting come from the settings' declaration (lingctl.runs.train_config)."""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from lingctl.commands.train_options import with_settings
from lingctl.runs.settings import walk
from lingctl.runs.train_config import TrainConfig


def test_every_flagged_setting_is_an_option_of_train() -> None:
    from lingctl.commands.train import app

    command = typer.main.get_command(app)
    options = {opt for p in command.params for opt in [*p.opts, *p.secondary_opts]}
    for _, _, s in walk(TrainConfig):
        if s.flag:
            assert set(s.flag.split("/")) <= options, s.flag
            assert s.short is None or s.short in options


def test_the_command_gets_the_values_given_by_dotted_setting_name() -> None:
    seen: dict[str, Any] = {}
    app = typer.Typer()

    @app.command()
    @with_settings(TrainConfig)
    def cmd(settings: dict[str, Any] | None = None, json: bool = False) -> None:
        seen.update(settings or {})

    res = CliRunner().invoke(app, ["--lr", "0.5", "-d", "a.txt", "--data", "b", "--max-seconds", "2m", "--no-watchdog"])
    assert res.exit_code == 0, res.output
    assert seen["optim.lr"] == 0.5 and seen["data.paths"] == ["a.txt", "b"] and seen["max_seconds"] == 120.0
    assert seen["watchdog"] is False and seen["steps"] is None and seen["data.tokenizer"] is None
    assert CliRunner().invoke(app, ["--dtype", "float16"]).exit_code == 2
